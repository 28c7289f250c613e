#!/usr/bin/env bash
# The H200 run behind the committed GPU results: one call of the device tool, carrying .whl
# (this repo's Python dependencies as wheels) and .gpu_assets (the SmolLM2 tokenizer for the GPU
# tests), both made by `.venv/bin/python benchmarks/gpu_assets.py [--baseline REV]` in a fresh
# checkout (with `.baseline_REV`, another checkout's atom for the A/B modes). Writes everything
# under $OUT/gpu.tgz (a tarball: the tool brings back few files).
# One or more modes a call, run in turn (a call runs at most 10 minutes; every step has a limit):
#   bash benchmarks/gpu_suite.sh bench    (benchmarks, about 8 minutes)
#   bash benchmarks/gpu_suite.sh check    (GPU tests and compute-sanitizer, about 9 minutes)
#   bash benchmarks/gpu_suite.sh grammar  (grammar process on/off profile and structured
#                                          overhead; about 6 minutes)
#   bash benchmarks/gpu_suite.sh spec     (GPU tests, bench_spec_decode, its host profile, memcheck
#                                          of asynchronous speculative decoding, and the decode's
#                                          device time per kernel; about 9 minutes)
#   BASELINE=.baseline bash benchmarks/gpu_suite.sh overlap  (host segments of a step, another
#                                          checkout against this one; about 7 minutes)
#   bash benchmarks/gpu_suite.sh structured (structured-output overhead, grammar process off and
#                                          on; about 8 minutes)
#   bash benchmarks/gpu_suite.sh final     (GPU tests, memcheck, structured overhead of one
#                                          schema, traces of a step; about 7 minutes)
#   bash benchmarks/gpu_suite.sh threads   (the grammar step and the structured-output overhead
#                                          with 4, 8 and 16 llguidance threads; ~8 minutes)
#   bash benchmarks/gpu_suite.sh tune      (decode attention launch configs, then the grammar
#                                          step on 16 threads; ~8 minutes)
#   bash benchmarks/gpu_suite.sh closing   (GPU tests, bench_engine, structured overhead of one
#                                          schema, memcheck; about 9 minutes)
#   BASELINE=.baseline bash benchmarks/gpu_suite.sh ab_structured (structured-output overhead,
#                                          another checkout against this one; about 4 minutes)
#   [ROUND=2] bash benchmarks/gpu_suite.sh gates (gates' GPU tests, structured-output overhead
#                                          with and without a grammar process; ~8 minutes)
#   bash benchmarks/gpu_suite.sh gates_closing (GPU tests, memcheck, structured-output overhead
#                                          with the defaults; about 9 minutes)
#   bash benchmarks/gpu_suite.sh gates_serving (bench_serving, then the mostly-allowed
#                                          structured-output overhead; about 6 minutes)
#   bash benchmarks/gpu_suite.sh gates_profile (host segments of a step with gates, the stream
#                                          operations, mask launch and tensor copies among them;
#                                          ~3 minutes)
#   bash benchmarks/gpu_suite.sh hooks_profile (the same at batch 64 and 256, with the engine
#                                          thread's functions under cProfile; ~3 minutes)
#   bash benchmarks/gpu_suite.sh threads_profile (the host's cores; the same at 2, 4, 8 and 15
#                                          llguidance threads in the grammar process; ~5 min)
#   BASELINE=.baseline bash benchmarks/gpu_suite.sh structured_ab (gates_ab's before/after
#                                          structured-output runs alone; ~2 minutes a round)
#   BASELINE=.baseline bash benchmarks/gpu_suite.sh decode_ab (the kernels' GPU tests, decode
#                                          ms/step of another checkout's atom against this one's,
#                                          alternated twice, then the gate operations; ~8 minutes)
#   BASELINE=.baseline [ROUNDS=1 REPEATS=3] bash benchmarks/gpu_suite.sh gates_ab (gates' GPU tests, the
#                                          gate operations, structured-output overhead of another
#                                          checkout's atom against this one's, alternated ROUNDS
#                                          times (2), memcheck; ~9 minutes, ~7 with ROUNDS=1)
#   BASELINE=.baseline [ROUNDS=2 KERNELS=1] bash benchmarks/gpu_suite.sh host_ab (decode
#                                          ms/step and the device's own ms/step of another
#                                          checkout's atom against this one's, alternated ROUNDS
#                                          times, 5 repeats each; then, unless KERNELS=0, this
#                                          one's kernels at batch 256; ~7 minutes)
#   bash benchmarks/gpu_suite.sh memcheck (compute-sanitizer memcheck of the engine's asynchronous
#                                          path with constrained requests; ~2 minutes)
#   BASELINE=.baseline bash benchmarks/gpu_suite.sh final_check (the GPU tests of CUDA graphs, the
#                                          grammar process and speculative decoding; the GEMMs;
#                                          one round of host_ab without kernels; ~5 minutes)
#   bash benchmarks/gpu_suite.sh split_probe (would two grammar processes of half the rows beat
#                                          one? bench_grammar_step at 256 rows on 16 cores, 128 on
#                                          8, and 128 on 8 twice at once on disjoint cores; the
#                                          GPU test of lazy text on CUDA; ~2 minutes)
#   bash benchmarks/gpu_suite.sh gemm     (the decode step's GEMMs per BLAS backend; ~1 minute)
#   bash benchmarks/gpu_suite.sh gates_check (the gates' and CUDA graphs' GPU tests, structured-
#                                          output overhead with the defaults; ~4 minutes)
#   [ROUNDS=1 REPEATS=2] bash benchmarks/gpu_suite.sh processes (the grammar process GPU tests,
#                                          then the structured-output overhead with one grammar
#                                          process and with two, alternated; ~6 minutes a round)
#   [ROUNDS=1 REPEATS=2] bash benchmarks/gpu_suite.sh processes_bench (the same without the tests)
#   bash benchmarks/gpu_suite.sh processes_profile (host segments of a step and the grammar
#                                          processes' time per gate at batch 64 and 256, one
#                                          process and two; ~4 minutes)
#   bash benchmarks/gpu_suite.sh pool_probe (the page lock's GPU tests; host segments of a step
#                                          and the children's commit and fill, 2 and 4 grammar
#                                          processes, batch 64 and 256; ~6 minutes)
#   BASELINE=.baseline [ROUNDS=1] bash benchmarks/gpu_suite.sh commit_probe (a commit's llguidance
#                                          calls in turn and in parallel; structured_ab; ~5 min)
#   [ROUNDS=2 REPEATS=3] bash benchmarks/gpu_suite.sh repeat_ab (batch 1 and 16, repeated gates
#                                          off and on, alternated; where the engine thread ran)
#   [ROUNDS=2] bash benchmarks/gpu_suite.sh placement_probe (pin_probe, then share_probe;
#                                          ~4 minutes a round)
#   [ROUNDS=2 BATCHES="1 16" REPEATS=3] bash benchmarks/gpu_suite.sh pin_probe (the engine
#                                          thread pinned and not, alternated; ~2 minutes a round)
#   [ROUNDS=2 CHILDREN=3] bash benchmarks/gpu_suite.sh children_probe (batch 256 over 2 grammar
#                                          processes and over CHILDREN, alternated; ~3 min a round)
#   [ROUNDS=2] bash benchmarks/gpu_suite.sh share_probe (batch 64 in one grammar process and
#                                          over two, alternated; ~2 minutes a round)
#   bash benchmarks/gpu_suite.sh gemm_probe (the GEMMs at 256 rows: cuBLAS, transposed, split-K
#                                          Triton, torch.compile max-autotune; ~4-9 minutes)
#   bash benchmarks/gpu_suite.sh hooks_probe (a gate's calls back to back and with cold caches,
#                                          then gates_profile; ~5 minutes)
#   BASELINE=.baseline [ROUNDS=1 ALONE_K=...] bash benchmarks/gpu_suite.sh alone_ab (greedy
#                                          parity with transformers, the grammar processes' GPU
#                                          tests (those ALONE_K selects), then structured_ab;
#                                          ~5 minutes a round)
#   bash benchmarks/gpu_suite.sh staging  (host µs of each call that stages a step's inputs:
#                                          page-locking, copies, events; ~1 minute)
#   bash benchmarks/gpu_suite.sh parity   (greedy parity with transformers on CUDA; ~1 minute)
#   bash benchmarks/gpu_suite.sh child_probe (a grammar process's gate on 1, 3, 7 and 14 threads
#                                          of the host's cores, and their topology; ~3 minutes)
#   [RACE_PROBES="add ..." RACE_VARIANTS="graphs-async"] bash benchmarks/gpu_suite.sh racecheck
#                                          (racecheck probes, then the engine's variants in float32
#                                          under a host-memory watchdog; ~8 minutes, ~4 for one
#                                          variant without probes: RACE_PROBES="")
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export ATOM_TEST_TOKENIZER_DIR=$PWD/.gpu_assets/smollm2-tokenizer
out=/tmp/gpu && rm -rf $out && mkdir -p $out  # a warm machine keeps the last call's files
pack() { tar czf "$OUT/gpu.tgz" -C $out .; }
trap pack EXIT
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log
    local name=$1 limit=$2; shift 2
    echo "== $name" | tee -a $out/summary.log
    timeout "$limit" "$@" >$out/$name.log 2>&1
    echo "rc=$? $name" | tee -a $out/summary.log
    grep -v "it/s\]" $out/$name.log | tail -n 30 >>$out/summary.log
    pack
}
bench() {
    step structured 170 python3 benchmarks/bench_structured_serving.py --random-llama-1b \
        --device cuda --out $out
    step engine 130 python3 benchmarks/bench_engine.py --device cuda --random-llama-1b --out $out
    step spec_decode 150 python3 benchmarks/bench_spec_decode.py --device cuda --tag _cuda \
        --model /tmp/atom-random-llama-1b-129k --out $out
}
check() {
    step pytest_gpu 240 python3 -m pytest -q -m gpu --durations=10 tests \
        --ignore=tests/reliability/test_schemathesis.py  # schemathesis is not carried
    step memcheck 120 compute-sanitizer --tool memcheck --print-limit 20 \
        python3 benchmarks/sanitize_engine.py
    # Racecheck in float32: the bf16 engine ends in a sanitizer internal error (see racecheck).
    step racecheck 200 bash -c "$(declare -f watched); watched 80 compute-sanitizer \
        --tool racecheck --print-limit 20 \
        python3 benchmarks/sanitize_engine.py cuda graphs-async float32"
}
grammar() {
    for mode in on off; do
        step profile_$mode 110 python3 benchmarks/profile_step.py --random-llama-1b --device cuda \
            --batch-sizes 1 16 64 256 --schemas mostly-forbidden --steps 16 --profile-steps 3 \
            --grammar-process $mode --tag grammar_process_$mode --out $out
    done
    step structured 170 python3 benchmarks/bench_structured_serving.py --random-llama-1b \
        --device cuda --out $out
}
watched() {  # watched GIB COMMAND...: kill COMMAND's tree past GIB of host RSS; log the peak
    local limit_kb=$(($1 * 1048576)) peak=0 rss tick=0; shift
    setsid "$@" & local pid=$!
    while kill -0 $pid 2>/dev/null; do
        rss=$(ps -o rss= -s $pid 2>/dev/null | awk '{s+=$1} END {print s+0}')  # its session
        ((rss > peak)) && peak=$rss
        ((rss > limit_kb)) && { echo "watchdog: killed at $((rss / 1024)) MiB"; kill -9 -- -$pid; }
        ((++tick % 10 == 0)) && echo "watchdog: ${tick} s, host RSS $((rss / 1024)) MiB"
        sleep 1
    done
    wait $pid; local rc=$?
    echo "peak host RSS $((peak / 1024)) MiB"
    return $rc
}
racecheck() {
    # Bf16 engine runs under racecheck end in "Internal Sanitizer Error" at the first forward,
    # whichever of ATOM's kernels is instrumented (2026-12-02): probe a cuBLAS GEMM alone in
    # bf16 and fp32, then check the engine's variants in float32, every kernel instrumented.
    for probe in ${RACE_PROBES-add rms_norm matmul_fp32 matmul_bf16}; do
        step race_probe_$probe 40 compute-sanitizer --tool racecheck --print-limit 20 \
            python3 benchmarks/racecheck_probe.py $probe
    done
    for variant in ${RACE_VARIANTS-eager-async graphs-async}; do
        step race_fp32_all_$variant 200 bash -c "$(declare -f watched); watched 80 \
            compute-sanitizer --tool racecheck --print-limit 20 \
            python3 benchmarks/sanitize_engine.py cuda $variant float32"
    done
}
spec() {  # asynchronous speculative decoding: GPU tests, benchmark, both sanitizers
    step pytest_gpu 240 python3 -m pytest -q -m gpu --durations=10 tests \
        --ignore=tests/reliability/test_schemathesis.py  # schemathesis is not carried
    step spec_decode 230 python3 benchmarks/bench_spec_decode.py --device cuda --tag _cuda \
        --model /tmp/atom-random-llama-1b-129k --max-tokens 64 --out $out
    step profile_spec_host 100 python3 benchmarks/profile_spec_host.py --device cuda --tag _cuda \
        --model /tmp/atom-random-llama-1b-129k --top 40 --out $out
    step memcheck_ngram 110 compute-sanitizer --tool memcheck --print-limit 20 \
        python3 benchmarks/sanitize_engine.py cuda graphs-async-ngram
    step kernels 150 python3 benchmarks/bench_engine.py --device cuda --random-llama-1b \
        --decode-batches 1 256 --variants graphs-async --profile --out $out/kernels
}
overlap() {  # before/after: BASELINE (another checkout's folder, carried) and this checkout,
    # alternated twice, one engine step's host segments; then the grammar step on 16 threads
    for round in 1 2; do
        for side in baseline current; do
            local root=$PWD
            [[ $side == baseline ]] && root=$PWD/${BASELINE:?a baseline checkout folder}
            step profile_${side}_$round 150 env PYTHONPATH=/tmp/site:$root python3 \
                $root/benchmarks/profile_step.py --random-llama-1b --device cuda \
                --batch-sizes 1 16 64 256 --schemas mostly-forbidden --steps 16 --profile-steps 2 \
                --tag ${side}_$round --out $out
        done
    done
    step profile_current_process 150 python3 benchmarks/profile_step.py --random-llama-1b \
        --device cuda --batch-sizes 1 16 64 256 --schemas mostly-forbidden --steps 16 \
        --profile-steps 2 --grammar-process on --tag current_process --out $out
    step grammar_step 100 python3 benchmarks/bench_grammar_step.py --tokenizers deepseek \
        --cases strings int-array --batches 64 256 --steps 20 --threads 16 --out $out
}
structured() {  # the structured-output overhead, grammar states in the engine's process and
    # in a process of their own (free-string is left out: the random model closes its string
    # within a few steps at batch 256, too few to time)
    for process in off on; do
        step structured_process_$process 280 python3 benchmarks/bench_structured_serving.py \
            --random-llama-1b --device cuda --schema-kinds mostly-allowed mostly-forbidden \
            --grammar-process $process --tag process_$process --out $out
    done
    step engine 130 python3 benchmarks/bench_engine.py --device cuda --random-llama-1b \
        --variants graphs-async --out $out
}
final() {  # one call: GPU tests, memcheck of the asynchronous path, the structured-output
    # overhead (mostly-forbidden), then where a constrained step's time goes at batch 16 and 64
    # (Chrome traces of host ranges and kernels)
    gpu_tests
    step memcheck 120 compute-sanitizer --tool memcheck --print-limit 20 \
        python3 benchmarks/sanitize_engine.py
    step structured 150 python3 benchmarks/bench_structured_serving.py --random-llama-1b \
        --device cuda --schema-kinds mostly-forbidden --tag final --out $out
    step profile_traced 120 python3 benchmarks/profile_step.py --random-llama-1b --device cuda \
        --batch-sizes 16 64 --schemas mostly-forbidden --steps 16 --profile-steps 3 --trace \
        --trace-dir $out --tag traced --out $out
}
threads() {  # llguidance executor threads: 4, 8, 16 (the default on the H200's 16 cores)
    for t in 4 8 16; do
        step grammar_step_$t 70 python3 benchmarks/bench_grammar_step.py --tokenizers deepseek \
            --cases int-array --batches 64 256 --steps 20 --threads $t --out $out/grammar_step_$t
    done
    for t in 4 8 16; do
        step structured_threads_$t 150 python3 benchmarks/bench_structured_serving.py \
            --random-llama-1b --device cuda --schema-kinds mostly-forbidden \
            --batch-sizes 16 64 256 --grammar-threads $t --tag threads_$t --out $out
    done
}
tune() {  # every decode attention KernelConfig; the grammar step (lanes spread after a burst)
    step grammar_step 70 python3 benchmarks/bench_grammar_step.py --tokenizers deepseek \
        --cases int-array strings --batches 64 256 --steps 20 --threads 16 --out $out
    step tune_decode 420 python3 benchmarks/tune_decode_attention.py --out $out
}
closing() {  # one call: GPU tests, decode ms/step, structured overhead, memcheck
    gpu_tests
    step engine 130 python3 benchmarks/bench_engine.py --device cuda --random-llama-1b \
        --variants graphs-async --out $out
    step structured 150 python3 benchmarks/bench_structured_serving.py --random-llama-1b \
        --device cuda --schema-kinds mostly-forbidden --tag closing --out $out
    step memcheck 120 compute-sanitizer --tool memcheck --print-limit 20 \
        python3 benchmarks/sanitize_engine.py
}
ab_structured() {  # before/after: BASELINE (another checkout's folder, carried) and this
    # checkout, alternated twice, the structured-output overhead at batch 1, 16 and 64
    for round in 1 2; do
        for side in baseline current; do
            local root=$PWD
            [[ $side == baseline ]] && root=$PWD/${BASELINE:?a baseline checkout folder}
            step structured_${side}_$round 90 env PYTHONPATH=/tmp/site:$root python3 \
                $root/benchmarks/bench_structured_serving.py --random-llama-1b --device cuda \
                --schema-kinds mostly-forbidden --batch-sizes 1 16 64 --repeats 2 \
                --tag ${side}_$round --out $out
        done
    done
}
gates() {  # gates (grammar_board): their GPU tests, then the structured-output overhead with
    # grammar states in the engine's process and in a grammar process, alternated (ROUND: 1
    # starts with the engine's, 2 with the grammar process)
    step pytest_gates 150 python3 -m pytest -q -m gpu --durations=5 \
        tests/structured_output/test_grammar_process.py tests/model_engine/test_cuda_graph.py
    local order="off on"
    [[ ${ROUND:-1} == 2 ]] && order="on off"
    for process in $order; do
        step structured_process_$process 170 python3 benchmarks/bench_structured_serving.py \
            --random-llama-1b --device cuda --schema-kinds mostly-forbidden \
            --grammar-process $process --tag gates_${process}_${ROUND:-1} --out $out
    done
}
gates_closing() {  # one call: GPU tests, memcheck (its runs use gates: the CUDA default), the
    # structured-output overhead with the defaults
    gpu_tests
    step memcheck 120 compute-sanitizer --tool memcheck --print-limit 20 \
        python3 benchmarks/sanitize_engine.py
    step structured 150 python3 benchmarks/bench_structured_serving.py --random-llama-1b \
        --device cuda --schema-kinds mostly-forbidden --tag gates_default --out $out
}
gates_serving() {  # with the defaults (gates): the online serving benchmark, then the
    # structured-output overhead of the mostly-allowed schema
    step serving 200 python3 benchmarks/bench_serving.py --random-llama-1b --device cuda \
        --client-procs 4 --out $out
    step structured_allowed 170 python3 benchmarks/bench_structured_serving.py \
        --random-llama-1b --device cuda --schema-kinds mostly-allowed --tag gates_allowed \
        --out $out
}
gates_profile() {  # where a constrained step's time goes with gates: the engine thread's
    # segments and the grammar process's own time per gate
    step profile_gates 170 python3 benchmarks/profile_step.py --random-llama-1b --device cuda \
        --batch-sizes 1 16 64 256 --schemas mostly-forbidden --steps 16 --profile-steps 2 \
        --grammar-process on --tag gates --out $out
}
hooks_profile() {  # the engine thread's Python, function by function (cProfile), plain and
    # constrained, beside the segments and the grammar process's time per gate
    step profile_hooks 200 python3 benchmarks/profile_step.py --random-llama-1b --device cuda \
        --batch-sizes 64 256 --schemas mostly-forbidden --steps 16 --profile-steps 2 \
        --cprofile-steps 16 --grammar-process on --tag hooks --out $out
}
threads_profile() {  # the host's cores, then gates_profile at batch 64 and 256 with the
    # grammar process's llguidance executor on 2, 4, 8 and 15 threads
    step topology 10 bash -c 'lscpu; grep . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list'
    for t in 2 4 8 15; do
        step profile_threads_$t 110 python3 benchmarks/profile_step.py --random-llama-1b \
            --device cuda --batch-sizes 64 256 --schemas mostly-forbidden --steps 24 \
            --profile-steps 2 --grammar-process on --grammar-threads $t --tag threads_$t --out $out
    done
}
decode_ab() {  # before/after decode: BASELINE (another checkout's folder holding its atom,
    # carried) and this checkout, both through this bench_engine.py, alternated twice
    step pytest_kernels 200 python3 -m pytest -q -m gpu --durations=5 tests/model_ops \
        tests/model_engine/test_cuda_graph.py
    for round in 1 2; do
        for side in baseline current; do
            local root=$PWD
            [[ $side == baseline ]] && root=$PWD/${BASELINE:?a baseline checkout folder}
            step engine_${side}_$round 120 env PYTHONPATH=/tmp/site:$root python3 \
                benchmarks/bench_engine.py --device cuda --random-llama-1b --no-transformers \
                --variants graphs-async --out $out/engine_${side}_$round
        done
    done
    step gate_ops 60 python3 benchmarks/bench_gate_ops.py --out $out
}
structured_ab() {  # the structured-output overhead of BASELINE (another checkout's folder
    # holding its atom, carried) and of this checkout, alternated ROUNDS times
    for round in $(seq ${ROUNDS:-2}); do
        for side in baseline current; do
            local root=$PWD
            [[ $side == baseline ]] && root=$PWD/${BASELINE:?a baseline checkout folder}
            step structured_${side}_$round 110 env PYTHONPATH=/tmp/site:$root python3 \
                benchmarks/bench_structured_serving.py --random-llama-1b --device cuda \
                --schema-kinds mostly-forbidden --repeats ${REPEATS:-2} --tag ${side}_$round --out $out
        done
    done
}
gates_ab() {  # gates before/after: BASELINE (another checkout's folder holding its atom,
    # carried) and this checkout, both through this bench_structured_serving.py
    step pytest_gates 180 python3 -m pytest -q -m gpu --durations=5 tests/spec_decode \
        tests/structured_output/test_grammar_process.py tests/model_engine/test_cuda_graph.py \
        tests/model_ops/test_triton_structured_output.py
    step gate_ops 45 python3 benchmarks/bench_gate_ops.py --rows 1 64 256 --iters 300 --out $out
    structured_ab
    step memcheck 110 compute-sanitizer --tool memcheck --print-limit 20 \
        python3 benchmarks/sanitize_engine.py
}
host_ab() {  # before/after of the host's share of a decode step: BASELINE (another checkout's
    # folder holding its atom, carried) and this checkout through this bench_engine.py, whose
    # device-only ms/step shows what the GPU alone takes
    for round in $(seq ${ROUNDS:-2}); do
        for side in baseline current; do
            local root=$PWD
            [[ $side == baseline ]] && root=$PWD/${BASELINE:?a baseline checkout folder}
            step engine_${side}_$round 110 env PYTHONPATH=/tmp/site:$root python3 \
                benchmarks/bench_engine.py --device cuda --random-llama-1b --no-transformers \
                --variants graphs-async --repeats 5 --out $out/engine_${side}_$round
        done
    done
    [[ ${KERNELS:-1} == 1 ]] || return 0  # KERNELS=0: the A/B alone
    step engine_kernels 110 python3 benchmarks/bench_engine.py --device cuda --random-llama-1b \
        --no-transformers --variants graphs-async --decode-batches 1 256 --profile \
        --out $out/kernels
}
final_check() {
    step pytest_final 200 python3 -m pytest -q -m gpu --durations=5 tests/spec_decode \
        tests/structured_output/test_grammar_process.py tests/model_engine/test_cuda_graph.py
    gemm
    for side in baseline current; do
        local root=$PWD
        [[ $side == baseline ]] && root=$PWD/${BASELINE:?a baseline checkout folder}
        step engine_$side 110 env PYTHONPATH=/tmp/site:$root python3 benchmarks/bench_engine.py \
            --device cuda --random-llama-1b --no-transformers --variants graphs-async \
            --repeats 5 --out $out/engine_$side
    done
}
split_probe() {
    local args="--tokenizers deepseek --cases int-array --steps 300 --warmup 5"  # overlapping
    step split_256_t15 60 taskset -c 0-15 python3 benchmarks/bench_grammar_step.py $args \
        --batches 256 --threads 15 --out $out/split_256_t15
    step split_128_t7 60 taskset -c 0-7 python3 benchmarks/bench_grammar_step.py $args \
        --batches 128 --threads 7 --out $out/split_128_t7
    step split_128_t7_twice 80 bash -c "
        taskset -c 0-7 python3 benchmarks/bench_grammar_step.py $args --batches 128 \
            --threads 7 --out $out/split_twice_a >$out/split_twice_a.log 2>&1 &
        taskset -c 8-15 python3 benchmarks/bench_grammar_step.py $args --batches 128 \
            --threads 7 --out $out/split_twice_b >$out/split_twice_b.log 2>&1
        wait"
    step pytest_text 120 python3 -m pytest -q -m gpu tests/model_engine/test_cuda_graph.py -k text
}
memcheck() {
    step memcheck 120 compute-sanitizer --tool memcheck --print-limit 20 \
        python3 benchmarks/sanitize_engine.py
}
gemm() {  # the decode step's GEMMs alone, cuBLAS against cuBLASLt
    step gemm 90 python3 benchmarks/bench_gemm.py --out $out
}
gemm_probe() {  # at 256 rows: cuBLAS, the transposed product and a split-K Triton GEMM (the
    # fastest of its configurations per shape); then torch.compile's autotuned Triton templates
    # (its table in the log)
    step gemm_splitk 240 python3 benchmarks/bench_gemm.py --rows 256 \
        --backends cublas cublas-t triton-splitk --out $out/gemm_splitk
    step gemm_inductor 300 python3 benchmarks/bench_gemm.py --rows 256 \
        --backends cublas inductor --out $out/gemm_inductor
}
gates_check() {  # the gates' GPU tests (a killed child among them) and the CUDA graphs', then
    # the structured-output overhead with the defaults
    step pytest_gates 200 python3 -m pytest -q -m gpu --durations=5 \
        tests/structured_output/test_grammar_process.py tests/model_engine/test_cuda_graph.py
    step structured 110 python3 benchmarks/bench_structured_serving.py --random-llama-1b \
        --device cuda --schema-kinds mostly-forbidden --tag gates_check --out $out
}
processes() {  # one grammar process per rank against two (the default on 16 cores)
    step pytest_processes 200 python3 -m pytest -q -m gpu --durations=5 \
        tests/structured_output/test_grammar_process.py
    processes_bench
}
processes_bench() {
    for round in $(seq ${ROUNDS:-1}); do
        for n in 1 2; do
            step structured_p${n}_$round 130 python3 benchmarks/bench_structured_serving.py \
                --random-llama-1b --device cuda --schema-kinds mostly-forbidden \
                --repeats ${REPEATS:-2} --grammar-processes $n --tag p${n}_$round --out $out
        done
    done
}
processes_profile() {  # segments of a step, and the busiest child's time per gate, 1 and 2
    for n in 1 2; do
        step profile_p$n 110 python3 benchmarks/profile_step.py --random-llama-1b --device cuda \
            --batch-sizes 64 256 --schemas mostly-forbidden --steps 24 --profile-steps 2 \
            --grammar-process on --grammar-processes $n --tag p$n --out $out
    done
}
pool_probe() {  # the page-lock fix's GPU tests, then where a batch-256 constrained step goes
    # with 2 grammar processes (the default) and with 4 (sharing from 16 live requests)
    step pytest_pool 200 python3 -m pytest -q -m gpu --durations=5 -o faulthandler_timeout=150 \
        "tests/model_engine/test_cuda_graph.py::test_graphs_with_a_structured_output_request" \
        tests/structured_output/test_grammar_board.py tests/structured_output/test_grammar_process.py
    for n in 2 4; do
        step profile_p$n 110 python3 benchmarks/profile_step.py --random-llama-1b --device cuda \
            --batch-sizes 64 256 --schemas mostly-forbidden --steps 24 --profile-steps 2 \
            --grammar-process on --grammar-processes $n --share-from $((n == 2 ? 64 : 16)) \
            --tag p$n --out $out
    done
}
commit_probe() {  # a commit's llguidance calls in turn or on the executor (7 cores, as one of
    # two grammar processes has them), then BASELINE's structured-output overhead against this
    # checkout's (structured_ab)
    step grammar_step 150 taskset -c 0-6 python3 benchmarks/bench_grammar_step.py \
        --tokenizers deepseek --cases int-array strings --batches 64 128 --steps 100 \
        --threads 7 --out $out
    structured_ab
}
repeat_ab() {  # batch 1 and 16 with repeated gates off and on, alternated ROUNDS times (2),
    # each run printing where the engine thread ran (bench_structured_serving's placement)
    for round in $(seq ${ROUNDS:-2}); do
        for repeat in off on; do
            step structured_repeat_${repeat}_$round 90 python3 benchmarks/bench_structured_serving.py \
                --random-llama-1b --device cuda --schema-kinds mostly-forbidden --batch-sizes 1 16 \
                --repeats ${REPEATS:-3} --repeat-gates $repeat --tag repeat_${repeat}_$round --out $out
        done
    done
}
placement_probe() {  # pin_probe, then share_probe
    pin_probe
    share_probe
}
share_probe() {  # batch 64 in one grammar process (share from 64, the default) and over two
    # (share from 32), alternated ROUNDS times (2)
    for round in $(seq ${ROUNDS:-2}); do
        for share in 64 32; do
            step structured_share_${share}_$round 90 python3 \
                benchmarks/bench_structured_serving.py --random-llama-1b --device cuda \
                --schema-kinds mostly-forbidden --batch-sizes 64 --repeats 2 \
                --share-from $share --tag share_${share}_$round --out $out
        done
    done
}
pin_probe() {  # the engine thread pinned to the core the grammar processes leave free and
    # not, alternated ROUNDS times (2), at BATCHES (1 16)
    for round in $(seq ${ROUNDS:-2}); do
        for pin in off on; do
            step structured_pin_${pin}_$round 110 python3 benchmarks/bench_structured_serving.py \
                --random-llama-1b --device cuda --schema-kinds mostly-forbidden \
                --batch-sizes ${BATCHES:-1 16} --repeats ${REPEATS:-3} \
                $([[ $pin == on ]] && echo --pin-engine-thread) --tag pin_${pin}_$round --out $out
        done
    done
}
children_probe() {  # batch 256 over 2 grammar processes (the default on 16 cores) and over
    # CHILDREN others (3), alternated ROUNDS times (2): a posted repeat and a quiet gate made each
    # child cheaper for the engine thread than when 4 lost to 2 (h200_2026-12-04j)
    for round in $(seq ${ROUNDS:-2}); do
        for n in 2 ${CHILDREN:-3}; do
            step structured_children_${n}_$round 100 python3 \
                benchmarks/bench_structured_serving.py --random-llama-1b --device cuda \
                --schema-kinds mostly-forbidden --batch-sizes 256 --repeats 2 \
                --grammar-processes $n --tag children_${n}_$round --out $out
        done
    done
}
hooks_probe() {  # why the engine thread's gate calls cost ~3x in place what they cost back to
    # back: each call after another workload's 64 MiB (cold caches) against back to back, then
    # gates_profile (its segments time the stream operations, mask launch and tensor copies)
    step gate_ops 60 python3 benchmarks/bench_gate_ops.py --rows 1 64 256 --iters 200 --out $out
    step gate_ops_cold 120 python3 benchmarks/bench_gate_ops.py --rows 1 64 256 --iters 100 \
        --cold --out $out
    gates_profile
}
child_probe() {  # a grammar process's repeated gate on the H200's host (no GPU work): how its
    # llguidance time scales with executor threads on the cores one of two children gets, and
    # what the host says of its cores
    step topology 20 bash -c "lscpu -e; grep . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list"
    for threads in 1 3 7; do
        step child_gate_t$threads 120 taskset -c 0-6 python3 benchmarks/bench_child_gate.py \
            --rows 64 128 --threads $threads --tag t$threads --out $out
    done
    step child_gate_t14 120 taskset -c 0-13 python3 benchmarks/bench_child_gate.py \
        --rows 64 128 --threads 14 --tag t14 --out $out
}
staging() {  # what staging a step's inputs costs the host, operation by operation
    step staging 120 python3 benchmarks/bench_staging.py --out $out
}
parity() {  # greedy parity with transformers on CUDA, graphs and eager
    step pytest_parity 120 python3 -m pytest -q -m gpu -k parity tests/model_engine/test_cuda_graph.py
}
alone_ab() {  # greedy parity with transformers and the grammar processes' GPU tests, then
    # structured_ab (a gate one grammar process alone takes part in fills on every spare core)
    step pytest_alone 150 python3 -m pytest -q -m gpu --durations=5 -k "${ALONE_K-parity or grammar_process}" \
        tests/model_engine/test_cuda_graph.py tests/structured_output/test_grammar_process.py
    structured_ab
}
gpu_tests() {  # the GPU tests alone (288 s on a cold H200 at 75926ed: 40 tests)
    step pytest_gpu 380 python3 -m pytest -q -m gpu --durations=10 -o faulthandler_timeout=150 tests \
        --ignore=tests/reliability/test_schemathesis.py  # schemathesis is not carried
}
: "${1:?one or more of: staging, parity, alone_ab, hooks_probe, pin_probe, share_probe, child_probe, gemm_probe, children_probe, placement_probe, repeat_ab, commit_probe, pool_probe, processes, processes_bench, processes_profile, bench, check, decode_ab, host_ab, final_check, split_probe, gemm, memcheck, gates_ab, gates_check, structured_ab, gpu_tests, grammar, overlap, racecheck, spec, structured, threads, tune, closing, ab_structured, gates, gates_closing, gates_serving, gates_profile, hooks_profile, threads_profile or final}"
for mode in "$@"; do "$mode"; done
tail -n 200 $out/summary.log
