"""Rejection sampler: greedy verification equals greedy decoding, speculative sampling emits the
target distribution exactly (chi-square tests), forbidden drafts never pass, seeded sequences do
not depend on the batch, relaxed acceptance accepts near-top drafts."""

from __future__ import annotations

import pytest
import torch

from atom.model_ops.rejection_sampler import RelaxedAcceptance, rejection_sample
from atom.model_ops.sampler import SamplingTensors

NEG_INF = float("-inf")
MIN_P_VALUE = 1e-3

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def _sampling(temps, device, top_k=None, gens=None) -> SamplingTensors:
    n = len(temps)
    return SamplingTensors(
        temperatures=torch.tensor(temps, device=device) if any(temps) else None,
        top_ks=None if top_k is None else torch.full((n,), top_k, device=device),
        top_ps=None,
        generators=gens or [None] * n,
    )


def _greedy_reference(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """Sequential greedy decoding: emit each row's argmax until one differs from the draft."""
    out, row = [], 0
    for d in drafts:
        emitted = []
        for j in range(len(d) + 1):
            emitted.append(int(logits[row + j].argmax()))
            if j == len(d) or d[j] != emitted[-1]:
                break
        out.append(emitted)
        row += len(d) + 1
    return out


def _random_batch(gen: torch.Generator, num_seqs: int, vocab: int, max_k: int):
    """Random logits with a third of the entries masked (never a whole row) and drafts that
    mostly follow each row's argmax, so that runs of accepted drafts of every length occur."""
    ks = torch.randint(0, max_k + 1, (num_seqs,), generator=gen).tolist()
    logits = torch.randn(sum(ks) + num_seqs, vocab, generator=gen) * 3
    mask = torch.rand(logits.shape, generator=gen) < 0.33
    mask[torch.arange(len(logits)), logits.argmax(-1)] = False
    logits = logits.masked_fill(mask, NEG_INF)
    drafts, row = [], 0
    for k in ks:
        best = logits[row : row + k].argmax(-1)
        noise = torch.randint(0, vocab, (k,), generator=gen)
        follow = torch.rand(k, generator=gen) < 0.75
        drafts.append(torch.where(follow, best, noise).tolist())
        row += k + 1
    return logits, drafts, mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_sequential_greedy_decoding(device, dtype):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits, drafts, _ = _random_batch(gen, num_seqs=12, vocab=50, max_k=5)
        logits = logits.to(dtype)
        expected = _greedy_reference(logits.float(), drafts)
        out = rejection_sample(logits.to(device), drafts, _sampling([0.0] * 12, device))
        tokens, accepted = out.tolist()
        assert tokens == expected
        assert accepted == [len(t) - 1 for t in tokens]
        # the same sequences greedy inside a batch whose other rows sample
        temps = [0.0 if i % 2 else 1.0 for i in range(12)]
        mixed, _ = rejection_sample(logits.to(device), drafts, _sampling(temps, device)).tolist()
        assert [m for i, m in enumerate(mixed) if i % 2] == expected[1::2]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_all_accepted_appends_the_bonus_token(device):
    logits = torch.randn(4 + 1 + 1, 30)
    drafts = [logits[:4].argmax(-1).tolist(), []]
    tokens, accepted = rejection_sample(
        logits.to(device), drafts, _sampling([0.0, 0.0], device)
    ).tolist()
    assert tokens == [drafts[0] + [int(logits[4].argmax())], [int(logits[5].argmax())]]
    assert accepted == [4, 0]


def _chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; cells of zero probability must be empty."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of zero target probability was emitted"
    expected = probs[support] * counts.sum()
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    df = torch.tensor(support.sum().item() - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, chi2 / 2))


def _binomial_z(successes: float, trials: int, rate: float) -> float:
    return abs(successes - trials * rate) / (trials * rate * (1 - rate)) ** 0.5


# Row targets over 6 tokens; token 5 is grammar-forbidden (-inf) in the first row.
TARGETS = torch.tensor(
    [
        [0.35, 0.25, 0.2, 0.12, 0.08, 0.0],
        [0.1, 0.3, 0.15, 0.05, 0.25, 0.15],
        [0.2, 0.2, 0.1, 0.3, 0.1, 0.1],
        [0.05, 0.15, 0.3, 0.2, 0.1, 0.2],
    ]
)
DRAFT_Q = torch.tensor(
    [
        [0.1, 0.2, 0.05, 0.3, 0.05, 0.3],  # much mass on the forbidden token
        [0.4, 0.1, 0.1, 0.1, 0.2, 0.1],
        [0.1, 0.5, 0.1, 0.1, 0.1, 0.1],
    ]
)


def _target_probs(temperature: float, top_k: int | None) -> torch.Tensor:
    logits = TARGETS.log() / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    return logits.softmax(-1)


def _verify_repeated(rows: torch.Tensor, drafts: torch.Tensor, q, temperature, top_k, device):
    """One batch of T identical sequences: logits rows [k+1, V], drafts [T, k] (a row per
    trial), q [k, V] draft distributions or None (one-hot)."""
    trials, k = drafts.shape
    logits = rows.log().repeat(trials, 1).to(device)
    draft_probs = None if q is None else q.repeat(trials, 1).to(device)
    sampling = _sampling([temperature] * trials, device, top_k=top_k)
    return rejection_sample(logits, drafts.tolist(), sampling, draft_probs).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, 4)])
@pytest.mark.parametrize("draft", [0, 3, 5, "model"])
def test_first_token_follows_the_target(device, temperature, top_k, draft):
    """k=1: the first emitted token ~ p_1 whatever the draft (the most likely token, an
    unlikely one, a forbidden one, or a draft model's sample); the acceptance rate is p_1(d)
    for a fixed draft and sum_x min(p_1, q_1) for a draft model."""
    torch.manual_seed(1)
    trials, p = 60_000, _target_probs(temperature, top_k)
    if draft == "model":
        q = DRAFT_Q[:1]
        drafts = torch.multinomial(q[0], trials, replacement=True).unsqueeze(1)
        rate = float(torch.minimum(p[0], q[0]).sum())
    else:
        q, drafts = None, torch.full((trials, 1), draft)
        rate = float(p[0, draft])
    tokens, accepted = _verify_repeated(TARGETS[:2], drafts, q, temperature, top_k, device)
    first = torch.tensor([t[0] for t in tokens])
    assert _chi2_p_value(torch.bincount(first, minlength=6), p[0]) > MIN_P_VALUE
    if 0 < rate < 1:
        assert _binomial_z(sum(accepted), trials, rate) < 5
    else:
        assert sum(accepted) == rate * trials


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["fixed", "model"])
def test_first_two_tokens_follow_the_joint_target(device, draft):
    """k=2 with row-dependent targets: (x1, x2) ~ p_1(x1) p_2(x2). A sequence that emitted only
    x1 gets x2 from a second verification step (rows p_2, p_3), as the engine would."""
    torch.manual_seed(2)
    trials, temperature = 120_000, 1.0
    if draft == "model":
        q = DRAFT_Q[1:]
        drafts = torch.stack([torch.multinomial(r, trials, replacement=True) for r in q], 1)
    else:
        q, drafts = None, torch.tensor([[2, 3]]).repeat(trials, 1)
    tokens, _ = _verify_repeated(TARGETS[:3], drafts, q, temperature, None, device)
    short = [i for i, t in enumerate(tokens) if len(t) == 1]
    again, _ = _verify_repeated(
        TARGETS[1:3], drafts[short, 1:], None if q is None else q[1:], temperature, None, device
    )
    for i, t in zip(short, again, strict=True):
        tokens[i].append(t[0])
    pairs = torch.tensor([t[0] * 6 + t[1] for t in tokens])
    joint = TARGETS[0].unsqueeze(1) * TARGETS[1].unsqueeze(0)
    assert _chi2_p_value(torch.bincount(pairs, minlength=36), joint) > MIN_P_VALUE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("with_q", [False, True])
def test_forbidden_drafts_are_never_accepted_nor_emitted(device, temperature, with_q):
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        logits, drafts, mask = _random_batch(gen, num_seqs=16, vocab=20, max_k=4)
        row = 0
        for d in drafts:  # every draft becomes a forbidden token of its row
            for j in range(len(d)):
                allowed = (~mask[row + j]).nonzero().flatten()
                d[j] = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
                logits[row + j, d[j]], mask[row + j, d[j]] = NEG_INF, True
            row += len(d) + 1
        q = None
        if with_q:  # a draft model that puts most of its mass on the forbidden drafts
            q = torch.rand(sum(map(len, drafts)), 20, generator=gen)
            q[torch.arange(len(q)), torch.tensor(sum(drafts, []), dtype=torch.long)] += 20
            q = (q / q.sum(-1, keepdim=True)).to(device)
        relaxed = RelaxedAcceptance(top_n=20, delta=1.0, seqs=[True] * 16)
        for rel in (None, relaxed):
            out = rejection_sample(
                logits.to(device), drafts, _sampling([temperature] * 16, device), q, rel
            )
            tokens, accepted = out.tolist()
            assert accepted == [0] * 16
            starts = [sum(len(d) + 1 for d in drafts[:i]) for i in range(16)]
            assert all(not mask[s, t[0]] for s, t in zip(starts, tokens, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sequence_does_not_depend_on_the_batch(device):
    torch.manual_seed(4)
    vocab, drafts = 1000, [[1, 2, 3], [4], [], [5, 6], [7, 8, 9, 10]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), vocab)
    row = 0
    for d in drafts:  # drafts of moderate probability, so that both outcomes occur
        logits[torch.arange(row, row + len(d)), d] += 6
        row += len(d) + 1
    alone_rows = slice(7, 10)  # the fourth sequence's rows

    def run(logits, drafts, seeds):
        gens = [None if s is None else torch.Generator(device).manual_seed(s) for s in seeds]
        sampling = _sampling([1.0] * len(drafts), device, gens=gens)
        return rejection_sample(logits.to(device), drafts, sampling).tolist()

    results = set()
    for seed in range(20):
        batch = run(logits, drafts, [11, None, 12, seed, None])
        alone = run(logits[alone_rows], drafts[3:4], [seed])
        assert (batch[0][3], batch[1][3]) == (alone[0][0], alone[1][0])
        assert run(logits[alone_rows], drafts[3:4], [seed]) == alone
        results.add(tuple(alone[0][0]))
    assert len(results) > 1  # the seed matters


@pytest.mark.parametrize("device", DEVICES)
def test_relaxed_accepts_a_near_top_draft(device):
    probs = torch.tensor([[0.45, 0.35, 0.15, 0.05, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]])
    logits, drafts = probs.log().to(device), [[1]]
    strict = rejection_sample(logits, drafts, _sampling([0.0], device))
    assert strict.tolist() == ([[0]], [0])

    def relaxed(top_n, delta, allowed=True, temperature=0.0):
        rule = RelaxedAcceptance(top_n, delta, [allowed])
        return rejection_sample(logits, drafts, _sampling([temperature], device), None, rule)

    assert relaxed(2, 0.2).tolist() == ([[1, 3]], [1])
    assert relaxed(2, 0.2, allowed=False).tolist() == ([[0]], [0])  # e.g. a constrained request
    assert relaxed(1, 0.2).tolist() == ([[0]], [0])  # not in the top 1
    assert relaxed(2, 0.05).tolist() == ([[0]], [0])  # 0.35 < 0.45 - 0.05
    # sampling: strict acceptance is p(1) = 0.35, relaxed acceptance is certain
    for _ in range(50):
        assert relaxed(2, 0.2, temperature=1.0).tolist()[1] == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_degenerate_distributions_have_no_nan(device):
    """All of p's mass on the draft (accepted whatever u is), and q == p (max(0, p - q) = 0)."""
    one_hot = torch.full((3, 8), NEG_INF)
    one_hot[:, 2] = 0.0
    sampling = _sampling([1.0], device)
    out = rejection_sample(one_hot.to(device), [[2, 2]], sampling)
    assert out.tolist() == ([[2, 2, 2]], [2])
    q = one_hot[:2].softmax(-1).to(device)
    assert rejection_sample(one_hot.to(device), [[2, 2]], sampling, q).tolist()[1] == [2]
    p = torch.randn(3, 8).softmax(-1)
    for _ in range(200):
        drafts = [torch.multinomial(p[:2], 1).flatten().tolist()]
        out = rejection_sample(p.log().to(device), drafts, sampling, p[:2].to(device))
        tokens, accepted = out.tolist()
        assert accepted == [2] and 0 <= tokens[0][-1] < 8


def test_shapes_are_checked():
    sampling = _sampling([0.0], "cpu")
    with pytest.raises(ValueError, match="logits rows"):
        rejection_sample(torch.randn(3, 10), [[1, 2, 3]], sampling)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.randn(3, 10), [[1, 2]], sampling, torch.rand(3, 10))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_verification_never_waits_for_the_device():
    logits, drafts, _ = _random_batch(torch.Generator().manual_seed(5), 64, 32000, 4)
    logits = logits.to("cuda", torch.bfloat16)
    gens = [torch.Generator("cuda").manual_seed(i) if i % 3 else None for i in range(64)]
    sampling = _sampling([0.0 if i % 4 == 0 else 0.8 for i in range(64)], "cuda", 50, gens)
    q = torch.rand(sum(map(len, drafts)), 32000, device="cuda").softmax(-1)
    relaxed = RelaxedAcceptance(8, 0.5, [i % 2 == 0 for i in range(64)])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = rejection_sample(logits, drafts, sampling, q, relaxed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, accepted = out.tolist()
    assert [len(t) for t in tokens] == [n + 1 for n in accepted]
