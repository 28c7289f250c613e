"""Running a kernel test's code under the Triton interpreter on CPU (what CI runs), in a process
of its own: ``TRITON_INTERPRET`` must be set before triton is first imported. The patches below
are prepended to the code so that it compares bit for bit with what the GPU computes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# The interpreter rounds float32 -> bfloat16 toward zero, where the GPU (and PyTorch) round to
# nearest even; give it PyTorch's conversion so that bfloat16 results can be compared exactly.
BF16_ROUND_SHIM = textwrap.dedent(
    """
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    _cast = interpreter.InterpreterBuilder.cast_impl

    def _cast_rtne(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return _cast(self, src, dst_type)
        wide = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        bits = wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits, tl.bfloat16)

    interpreter.InterpreterBuilder.cast_impl = _cast_rtne
    """
)


# triton-lang/triton#11584: the interpreter's tl.dot multiplies bfloat16 bit patterns (it keeps
# bfloat16 as uint16); widen such operands to float32 first, as the GPU's MMA does.
BF16_DOT_SHIM = textwrap.dedent(
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    _dot = interpreter.InterpreterBuilder.create_dot

    def _wide(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    interpreter.InterpreterBuilder.create_dot = lambda self, a, b, *rest: _dot(self, _wide(a), _wide(b), *rest)
    """
)


def run_interpreted(code: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """``code`` (which must print what the test checks) in a child with the interpreter on and
    both patches applied; ``DEVICE`` is ``"cpu"`` there."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-c", BF16_DOT_SHIM + BF16_ROUND_SHIM + "DEVICE = 'cpu'\n" + code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
