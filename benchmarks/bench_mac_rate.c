// Multiply-add throughput of one core, register-only: 24 independent zmm (or 8 x 3 ymm)
// accumulators, so neither latency nor memory limits it; plus 1-accumulator latency chains.
// Answers "does this CPU issue vdpbf16ps slower than FMA per multiply-add?" (issue 34):
//   gcc -O2 -mavx512f -mavx512bf16 -mavx512vl -o /tmp/mac_rate benchmarks/bench_mac_rate.c
//   /work/locks/bench taskset -c 1 /tmp/mac_rate
// Needs AVX512-BF16 (SIGILL otherwise). One instruction: FMA 16 multiply-adds (zmm),
// vdpbf16ps 32 (two bf16 products per float32 lane).
#include <stdio.h>
#include <time.h>
#include <string.h>
#include <stdlib.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define R8(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7)
#define R16(op) R8(op) op(8) op(9) op(10) op(11) op(12) op(13) op(14) op(15)
#define R24(op) R16(op) op(16) op(17) op(18) op(19) op(20) op(21) op(22) op(23)
#define FMA(i) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define DP(i)  "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define FMAY(i) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define DPY(i)  "vdpbf16ps %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define FMAL(i) "vfmadd231ps %%zmm30, %%zmm31, %%zmm0\n\t"
#define DPL(i) "vdpbf16ps %%zmm30, %%zmm31, %%zmm0\n\t"
#define CLOB "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15","xmm16","xmm17","xmm18","xmm19","xmm20","xmm21","xmm22","xmm23","xmm30","xmm31"
static void fma24(long n){ __asm__ volatile("vpxord %%zmm30,%%zmm30,%%zmm30\n\tvpxord %%zmm31,%%zmm31,%%zmm31\n\t1:\n\t" R24(FMA) "dec %0\n\tjnz 1b\n\t" : "+r"(n) :: CLOB, "cc"); }
static void dp24(long n){ __asm__ volatile("vpxord %%zmm30,%%zmm30,%%zmm30\n\tvpxord %%zmm31,%%zmm31,%%zmm31\n\t1:\n\t" R24(DP) "dec %0\n\tjnz 1b\n\t" : "+r"(n) :: CLOB, "cc"); }
static void fmalat(long n){ __asm__ volatile("vpxord %%zmm30,%%zmm30,%%zmm30\n\tvpxord %%zmm31,%%zmm31,%%zmm31\n\t1:\n\t" R24(FMAL) "dec %0\n\tjnz 1b\n\t" : "+r"(n) :: CLOB, "cc"); }
static void dplat(long n){ __asm__ volatile("vpxord %%zmm30,%%zmm30,%%zmm30\n\tvpxord %%zmm31,%%zmm31,%%zmm31\n\t1:\n\t" R24(DPL) "dec %0\n\tjnz 1b\n\t" : "+r"(n) :: CLOB, "cc"); }
static void fmay24(long n){ __asm__ volatile("vpxor %%ymm14,%%ymm14,%%ymm14\n\tvpxor %%ymm15,%%ymm15,%%ymm15\n\t1:\n\t" R8(FMAY) R8(FMAY) R8(FMAY) "dec %0\n\tjnz 1b\n\t" : "+r"(n) :: CLOB, "cc"); }
static void dpy24(long n){ __asm__ volatile("vpxor %%ymm14,%%ymm14,%%ymm14\n\tvpxor %%ymm15,%%ymm15,%%ymm15\n\t1:\n\t" R8(DPY) R8(DPY) R8(DPY) "dec %0\n\tjnz 1b\n\t" : "+r"(n) :: CLOB, "cc"); }
typedef void (*fn)(long);
static void run(const char*name, fn f, int macs_per_insn){
  long n=20000000; f(n/10);
  double best=1e9; for(int r=0;r<5;r++){double t=now(); f(n); t=now()-t; if(t<best)best=t;}
  double insn=24.0*n; printf("%-28s %6.2f G insn/s  %7.1f GMAC/s  (%.3f ns/insn)\n",name,insn/best*1e-9,insn*macs_per_insn/best*1e-9,best/insn*1e9);
}
int main(){
  run("zmm FMA, 24 acc",fma24,16);
  run("zmm vdpbf16ps, 24 acc",dp24,32);
  run("ymm FMA, 8 acc x3",fmay24,8);
  run("ymm vdpbf16ps, 8 acc x3",dpy24,16);
  run("zmm FMA, 1 acc (latency)",fmalat,16);
  run("zmm vdpbf16ps, 1 acc (lat)",dplat,32);
  run("zmm FMA, 24 acc (again)",fma24,16);
  run("zmm vdpbf16ps, 24 acc (again)",dp24,32);
  return 0;
}
