"""What a frozen quantized linear layer costs on a CUDA GPU, per GEMM, in PyTorch's own ops: the
choices issue 21 names for weft's model.quantize on CUDA (LibTorch ops first; int8 matmul where
LibTorch has one, dequantize-then-GEMM otherwise).

For the Llama 3.2 1B shape's projections at T tokens (x bf16 [T, in], W [out, in]):
  bf16          x @ W^T with W held in bf16 (the unquantized base)
  int8 deq      W int8 + per-row absmax (LLM.int8's vector-wise layout) dequantized to bf16, then the
                bf16 GEMM: what weft's quantized_linear does
  int8 _int_mm  x quantized per row to int8 (absmax), torch._int_mm (cuBLASLt int8 x int8 -> int32),
                rescaled by both absmaxes: LLM.int8 without its outlier columns
  nf4 deq       W in nf4 blocks of 64 (fp32 absmax) dequantized to bf16, then the bf16 GEMM
Times are CUDA-event medians of 50 runs after 10; error is relative Frobenius against x @ W^T in
fp32. Usage: python3 tools/gpu/quant_gemm_bench.py [--tokens 2048]"""
import argparse
import torch

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=2048)
args = p.parse_args()
dev = torch.device("cuda")
torch.manual_seed(0)
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0], device=dev)


def timed(fn, reps=50, warm=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def rel(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, tokens {args.tokens}")
print(f"{'projection':<16}{'bf16 ms':>9}{'int8 deq ms':>12}{'_int_mm ms':>11}{'nf4 deq ms':>11}"
      f"{'int8 deq err':>13}{'_int_mm err':>12}{'nf4 err':>9}")
totals = [0.0, 0.0, 0.0, 0.0]
for name, out_f, in_f, count in [("q_proj/o_proj", 2048, 2048, 2), ("k_proj/v_proj", 512, 2048, 2),
                                 ("gate/up_proj", 8192, 2048, 2), ("down_proj", 2048, 8192, 1)]:
    w = torch.randn(out_f, in_f, device=dev) * 0.02
    x = torch.randn(args.tokens, in_f, device=dev).bfloat16()
    ref = x.float() @ w.t()
    w16 = w.bfloat16()
    scb = w.abs().amax(1)
    cb = torch.round(w * (127 / scb.unsqueeze(1))).to(torch.int8)
    blocks = w.reshape(-1, 64)
    absmax = blocks.abs().amax(1)
    idx = torch.bucketize(blocks / absmax.unsqueeze(1), (NF4[:-1] + NF4[1:]) / 2).to(torch.uint8)
    packed = (idx.reshape(-1, 2)[:, 0] << 4) | idx.reshape(-1, 2)[:, 1]

    def bf16():
        return x @ w16.t()

    def int8_deq():
        return x @ (cb.float() * (scb / 127).unsqueeze(1)).bfloat16().t()

    def int8_mm():
        sx = x.float().abs().amax(1, keepdim=True)
        xq = torch.round(x.float() * (127 / sx)).to(torch.int8)
        return (torch._int_mm(xq, cb.t()).float() * (sx / 127) * (scb / 127)).bfloat16()

    def nf4_deq():
        i = torch.stack([packed >> 4, packed & 15], 1).reshape(-1).long()
        wd = (NF4[i].reshape(-1, 64) * absmax.unsqueeze(1)).reshape(out_f, in_f).bfloat16()
        return x @ wd.t()

    fns = [bf16, int8_deq, int8_mm, nf4_deq]
    ms = [timed(f) for f in fns]
    errs = [rel(int8_deq(), ref), rel(int8_mm(), ref), rel(nf4_deq(), ref)]
    for k in range(4):
        totals[k] += count * ms[k]
    print(f"{name:<16}" + "".join(f"{t:>{wd}.3f}" for t, wd in zip(ms, [9, 12, 11, 11]))
          + f"{errs[0]:>13.2e}{errs[1]:>12.2e}{errs[2]:>9.2e}")
print(f"{'one block':<16}" + "".join(f"{t:>{wd}.3f}" for t, wd in zip(totals, [9, 12, 11, 11]))
      + "   (forward GEMMs of one decoder block, ms)")
