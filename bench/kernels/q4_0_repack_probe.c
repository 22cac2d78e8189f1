/* The q4_0 decode row dot in two weight layouts, in C, one thread: what an interleaved ("repacked")
 * copy of the rows would buy the decode GEMVs (docs/performance.md, "EPYC Zen 4 VM, 2026-12-07").
 *
 *   gcc -O3 -march=native -o /tmp/q4_0_repack_probe bench/kernels/q4_0_repack_probe.c
 *   /tmp/q4_0_repack_probe         # 2048 rows x 1024 (1.2 MB: in cache)
 *   /tmp/q4_0_repack_probe big     # 65536 rows x 1024 (37.7 MB: from DRAM)
 *
 * A: the structure of kernels/_simd_int8_low.py's q4_0 step (GGUF layout, one row at a time; 8
 *    blocks' integer dots by vpdpbusd, summed across lanes by a hadd tree, scaled per block).
 * R: 8 rows interleaved per block (their 8 fp16 scales, then for each 4-byte column the 8 rows'
 *    bytes): a dword of x broadcast to all lanes, lane j accumulates row j, so no per-block
 *    horizontal sums. Needs AVX512-VNNI (vpdpbusd on 256 bits); prints G weights/s and one output
 *    of each (they agree).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define NB 32
#define ROWS 2048
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
static inline __m256i nib(const uint8_t* q){
  __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)q));
  both = _mm256_srlv_epi32(both, _mm256_setr_epi32(0,0,0,0,4,4,4,4));
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}
static inline __m256i hadd(__m256i a, __m256i b){return _mm256_hadd_epi32(a,b);}
float rowA(const uint8_t* row, const int8_t* xq, const float* xd, const float* xs){
  __m256 acc=_mm256_setzero_ps();
  for(int b0=0;b0<NB;b0+=8){
    __m256i s[8];
    for(int j=0;j<8;j++){const uint8_t* bl=row+18*(b0+j); s[j]=_mm256_dpbusd_epi32(_mm256_setzero_si256(), nib(bl+2), _mm256_loadu_si256((const __m256i*)(xq+32*(b0+j))));}
    __m256i p0=hadd(s[0],s[1]),p1=hadd(s[2],s[3]),p2=hadd(s[4],s[5]),p3=hadd(s[6],s[7]);
    __m256i q0=hadd(p0,p1),q1=hadd(p2,p3);
    __m256i t=_mm256_add_epi32(_mm256_permute2x128_si256(q0,q1,0x20),_mm256_permute2x128_si256(q0,q1,0x31));
    uint16_t dh[8]; for(int j=0;j<8;j++) memcpy(&dh[j], row+18*(b0+j), 2);
    __m256 d=_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)dh));
    __m256 dots=_mm256_fmadd_ps(_mm256_loadu_ps(xs+b0), _mm256_set1_ps(-8.f), _mm256_mul_ps(_mm256_cvtepi32_ps(t), _mm256_loadu_ps(xd+b0)));
    acc=_mm256_fmadd_ps(dots,d,acc);
  }
  __m128 r=_mm_add_ps(_mm256_castps256_ps128(acc),_mm256_extractf128_ps(acc,1));
  r=_mm_hadd_ps(r,r); r=_mm_hadd_ps(r,r); return _mm_cvtss_f32(r);
}
// repacked: per group of 8 rows, per block: 8 fp16 d (16 B), then 128 B quants: for c in 0..3: rows 0..7 dword c (32 B)
#define RB (16+128)
void repack(const uint8_t* W, int stride, uint8_t* R){
  for(int g=0; g<ROWS/8; g++) for(int b=0;b<NB;b++){
    uint8_t* o=R+((size_t)g*NB+b)*RB;
    for(int r=0;r<8;r++) memcpy(o+2*r, W+(size_t)(8*g+r)*stride+18*b, 2);
    for(int c=0;c<4;c++) for(int r=0;r<8;r++) memcpy(o+16+32*c+4*r, W+(size_t)(8*g+r)*stride+18*b+2+4*c, 4);
  }
}
void rows8_repacked(const uint8_t* R, const int8_t* xq, const float* xd, const float* xs, float* out){
  __m256 acc=_mm256_setzero_ps(), off=_mm256_setzero_ps();
  __m256i m15=_mm256_set1_epi8(15);
  for(int b=0;b<NB;b++){
    const uint8_t* o=R+(size_t)b*RB;
    const int32_t* xw=(const int32_t*)(xq+32*b);
    __m256i acci=_mm256_setzero_si256();
    for(int c=0;c<4;c++){
      __m256i q=_mm256_loadu_si256((const __m256i*)(o+16+32*c));
      acci=_mm256_dpbusd_epi32(acci,_mm256_and_si256(q,m15),_mm256_set1_epi32(xw[c]));
      acci=_mm256_dpbusd_epi32(acci,_mm256_and_si256(_mm256_srli_epi16(q,4),m15),_mm256_set1_epi32(xw[4+c]));
    }
    __m256 d=_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    acc=_mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acci),_mm256_set1_ps(xd[b])),d,acc);
    off=_mm256_fmadd_ps(d,_mm256_set1_ps(xs[b]),off);
  }
  _mm256_storeu_ps(out,_mm256_fmadd_ps(off,_mm256_set1_ps(-8.f),acc));
}
int main(int argc, char** argv){
  int stride=18*NB; int big = argc>1; size_t nrows = big? 65536: ROWS;
  uint8_t* W=aligned_alloc(64,nrows*stride+64); for(size_t i=0;i<nrows*stride;i++) W[i]=rand();
  for(size_t r=0;r<nrows;r++){ for(int b=0;b<NB;b++){uint16_t h=0x2c00+(rand()%64); memcpy(W+r*stride+18*b,&h,2);}}
  uint8_t* R=aligned_alloc(64,nrows/8*NB*RB+64);
  for(size_t g=0; g<nrows/ROWS; g++) repack(W+g*ROWS*stride, stride, R+g*(ROWS/8)*NB*RB);
  int8_t xq[32*NB]; float xd[NB], xs[NB]; for(int i=0;i<32*NB;i++) xq[i]=rand()%255-127; for(int b=0;b<NB;b++){xd[b]=0.01f*(1+b%3); xs[b]=0.5f;}
  float* out=malloc(nrows*4); float chk[2]={0};
  for(int rep=0;rep<4;rep++){
   for(int v=0;v<2;v++){
    double t=now(); int it=big?10:200;
    for(int k=0;k<it;k++){
      if(v==0) for(size_t r=0;r<nrows;r++) out[r]=rowA(W+r*stride,xq,xd,xs);
      if(v==1) for(size_t r=0;r<nrows;r+=8) rows8_repacked(R+(r/8)*NB*RB,xq,xd,xs,out+r);
    }
    double dt=now()-t; chk[v]=out[13];
    printf("%c %.1f Gw/s  ", "AR"[v], (double)nrows*NB*32*it/dt/1e9);
   }
   printf(" chk %g %g\n", chk[0],chk[1]);
  }
}
