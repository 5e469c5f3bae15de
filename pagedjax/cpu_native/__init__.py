"""C++ kernels for XLA:CPU, called through the XLA FFI: the CPU platform's fast path.

- `build.py`: compiles `csrc/*.cc` once per machine with the system C++ compiler and registers
  the FFI targets; every wrapper calls through `build.ffi_call`.
- `attention.py`: ragged paged attention on a float32, bf16, fp16 or fp8 pool, and the write of
  a step's K/V into the narrower pools (the "cpu_native" backend).
- `matmul.py`: weights packed at load time (float32 panels, GGUF block codes) and their matmul.
- `sampling.py`: greedy, truncated draws and token logprobs (the CPU's `SamplingKernels`).

Nothing outside `pagedjax/platforms/cpu.py` and the attention registry chooses these; the
model code never imports them.
"""
