// kvoffload's copy kernel: copies a table of (src, dst, len) runs between device memory and
// pinned, device-mapped host memory with the SMs instead of the copy engines.
//
// Why: vLLM keeps each layer's K and V in their own tensors, so one block is dozens of
// small copies (32 KiB for a Llama-3-8B layer), and the copy engines pay a fixed cost per
// copy that caps them far below PCIe's bandwidth there; a handful of thread blocks
// streaming 16-byte words reach it. Large runs still go to the copy engines, which use no
// SMs.
//
// The PTX beside this file is generated from it by scripts/build_copy_kernel.py (NVRTC,
// compute_70, PTX ISA 7.8, so any driver kvoffload accepts can JIT it); do not edit the PTX.

struct Run {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long len;
};

// One thread block per run at a time (grid-stride over the table). Each thread keeps eight
// 16-byte loads in flight before storing them: reads from host memory take microseconds to
// come back, and only many outstanding reads fill the link.
extern "C" __global__ void __launch_bounds__(256)
kvoffload_copy(const Run* __restrict__ table, unsigned long long count) {
    const unsigned long long threads = blockDim.x;
    for (unsigned long long i = blockIdx.x; i < count; i += gridDim.x) {
        const Run run = table[i];
        if (((run.src | run.dst | run.len) & 15ull) == 0) {
            const int4* __restrict__ src = reinterpret_cast<const int4*>(run.src);
            int4* __restrict__ dst = reinterpret_cast<int4*>(run.dst);
            const unsigned long long words = run.len >> 4;
            unsigned long long w = threadIdx.x;
            for (; w + 7 * threads < words; w += 8 * threads) {
                int4 v[8];
#pragma unroll
                for (int k = 0; k < 8; k++) v[k] = src[w + k * threads];
#pragma unroll
                for (int k = 0; k < 8; k++) dst[w + k * threads] = v[k];
            }
            for (; w < words; w += threads) dst[w] = src[w];
        } else {
            const unsigned char* src = reinterpret_cast<const unsigned char*>(run.src);
            unsigned char* dst = reinterpret_cast<unsigned char*>(run.dst);
            for (unsigned long long b = threadIdx.x; b < run.len; b += threads) dst[b] = src[b];
        }
    }
}
