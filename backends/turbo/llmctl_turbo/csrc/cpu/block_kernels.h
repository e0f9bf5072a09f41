// GGUF block-quantized linear layers (quantization=gguf), compiled once per instruction
// set like row_kernels.h (included after it, in the same namespaces; kVnni is true only in
// the avx512vnni one).
//
// Weights: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 blocks, repacked at load by pack_gguf_weight
// (cpu_kernels.cpp) into panels of kPanelWidth = 16 output features. Every format becomes
// one form, per block of 32 inputs and per feature: w = d * q + c, with q an UNSIGNED
// integer (so that one VNNI instruction, unsigned x signed bytes, multiplies it):
//   Q8_0: q = q8 + 128, c = -128 d;   Q4_0: q = nibble, c = -8 d;   Q4_1: q = nibble, c = m;
//   Q5_0: q = 5 bits, c = -16 d;      Q5_1: q = 5 bits, c = m (in the 8-bit grid).
// Packed layout: uint8 [panels][K / 32 blocks][block bytes]; one block of one panel is
//   fp16 d[16], fp16 c[16]                         64 bytes (Q8_0, Q4_0: d[16] alone,
//                                                   32 bytes; their zero point 128 or 8
//                                                   comes off the integer sums, below)
//   8-bit: uint8 q[8 groups][16 features][4]       512 bytes (group g: inputs 4g .. 4g+3)
//   4-bit: uint8 q[4 chunks][16 features][4]       256 bytes (chunk j: low nibbles are
//                                                   group j, high nibbles group j + 4)
// so one 64-byte load holds 4 inputs of each of the 16 features, and vpdpbusd against 4
// broadcast activation bytes sums each feature's 4 products into its own int32 lane: no
// horizontal sums, and a panel's blocks stream from memory in order. d and c are fp16, as
// in the file (exact: -8d and -128d only shift the exponent), so a packed Q4_1 matrix
// takes the file's 5 bits per weight, Q8_0 8.5 and Q4_0 4.5 (the files' own).
//
// K-quants (Q4_K, Q5_K, Q6_K) keep their super-blocks of 256 (cpu/block_layout.h): per
// super-block and feature fp16 D (and M = -Dmin), per 32-block one byte s0 and one s1, and
// the quants in the same grids, so a block's d and c are made in registers from them:
//   Q4_K, Q5_K: d = D * s0, c = M * s1 (5-bit q in the 8-bit grid);
//   Q6_K: two 16-input halves, d = D * s_half, and the zero point 32 subtracted from the
//   integer sums (sum (q - 32) xq = sum q xq - 32 sum xq, per half), so no c.
// D * s is exact in fp32 (11 x 8 significant bits), so the kernel runs the file's weights
// exactly. Resident size: Q4_K 4.625 bits per weight (the file's 4.5), Q5_K and Q6_K 8.625
// and 8.5625 (the files' 5.5 and 6.5625: their quants take a byte each, as the 8-bit grid
// multiplies them without unpacking).
//
// Activations are quantized per block of 32 to int8, as llama.cpp does:
//   dx = max|x| / 127, xq = round(x * (1 / dx)), sx = dx * sum(xq), and then
//   x . w over a block = d * dx * sum(q * xq) + c * sx,
// the integer sum exact in int32. That is llama.cpp's choice over dequantizing weights to
// float in registers: 64 multiply-adds per instruction instead of 16, and no int-to-float
// conversion per weight (measured in docs/benchmarks.md against turbo's int8 kernel, which
// converts in registers). Its cost is the activations' 8-bit rounding, as in llama.cpp.
// A symmetric type (Q8_0, Q4_0: c = -z d) takes its zero point off the integer sum
// instead, d * dx * (sum(q * xq) - z * sum(xq)), as Q6_K's halves do: exact, where c * sx
// cancelled most of the first term in floats, and one multiply-add fewer per row, feature
// and block (multiply-adds share their execution ports with vpdpbusd).

constexpr int64_t kQuantBlock = 32;                                     // inputs per block
constexpr int64_t kGridBytes = 64;  // one group of 4 inputs x 16 features in a grid

// x's rows quantized per 32-block: q [M][K] int8, dx and sx [M][K / 32], and the integer
// sums of xq per 16 inputs [M][K / 16] (Q6_K's zero point).
struct QuantizedRows {
  const int8_t* q;
  const float* dx;
  const float* sx;
  const int32_t* half_sums;
  int64_t K, blocks;
};

#ifdef TURBO_CPU_X86
// One row's blocks quantized as quantize_activations' portable loop does, 16 inputs per
// vector: the same max, scale and round-to-nearest-even (the default rounding mode of
// vcvtps2dq, as of nearbyint), so the same bytes. A scalar loop cost about 8 % of a
// 5-token verification step on SmolLM2 Q4_1; this takes a few instructions per block.
// A template, so that only the AVX-512 namespaces, which call it, compile it.
template <int Lanes>
inline void quantize_row_blocks_avx512(const float* x, int64_t blocks, int8_t* q, float* dx,
                                       float* sx, int32_t* half_sums) {
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 low = _mm512_loadu_ps(x + b * kQuantBlock);
    const __m512 high = _mm512_loadu_ps(x + b * kQuantBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
    const float d = amax / 127.f;
    const __m512 inverse = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
    const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kQuantBlock), _mm512_cvtepi32_epi8(q_low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kQuantBlock + 16),
                     _mm512_cvtepi32_epi8(q_high));
    const int32_t sum_low = _mm512_reduce_add_epi32(q_low);
    const int32_t sum_high = _mm512_reduce_add_epi32(q_high);
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum_low + sum_high);
    half_sums[2 * b] = sum_low;
    half_sums[2 * b + 1] = sum_high;
  }
}
#endif

inline QuantizedRows quantize_activations(const float* x, int64_t x_stride, int64_t M,
                                          int64_t K) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> halves;
  const int64_t blocks = K / kQuantBlock;
  q.resize(M * K);
  scales.resize(2 * M * blocks);
  halves.resize(2 * M * blocks);
  int8_t* qs = q.data();
  float* dx = scales.data();
  float* sx = dx + M * blocks;
  int32_t* half_sums = halves.data();
  parallel_for(0, M, grain_for(4 * K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#ifdef TURBO_CPU_X86
      if constexpr (kVectorWidth == 16) {  // the same values, a block per two vectors
        quantize_row_blocks_avx512<kVectorWidth>(x + r * x_stride, blocks, qs + r * K, dx + r * blocks,
                                   sx + r * blocks, half_sums + r * blocks * 2);
        continue;
      }
#endif
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + r * x_stride + b * kQuantBlock;
        float amax = 0.f;
        for (int i = 0; i < kQuantBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 127.f;
        const float inverse = d > 0.f ? 1.f / d : 0.f;
        int8_t* qb = qs + r * K + b * kQuantBlock;
        int32_t sum[2] = {0, 0};
        for (int i = 0; i < kQuantBlock; ++i) {
          qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inverse));
          sum[i / 16] += qb[i];
        }
        dx[r * blocks + b] = d;
        sx[r * blocks + b] = d * static_cast<float>(sum[0] + sum[1]);
        half_sums[(r * blocks + b) * 2] = sum[0];
        half_sums[(r * blocks + b) * 2 + 1] = sum[1];
      }
    }
  });
  return {qs, dx, sx, half_sums, K, blocks};
}

// The 4 weight bytes of feature f, inputs 4g .. 4g+3, of one packed block's quants.
template <int Bits>
inline uint8_t grid_quant(const uint8_t* q, int g, int f, int kk) {
  if constexpr (Bits == 8) {
    return q[g * kGridBytes + f * 4 + kk];
  } else {
    const uint8_t byte = q[(g & 3) * kGridBytes + f * 4 + kk];
    return g < 4 ? byte & 0x0F : byte >> 4;
  }
}

// Where block b (of 32 inputs) of a panel keeps its quants.
template <int Layout>
inline const uint8_t* block_quants(const uint8_t* panel, int64_t b) {
  if constexpr (is_super_layout(Layout)) {
    return panel + (b / kSuperSubBlocks) * super_block_bytes(Layout) +
           super_header_bytes(Layout) + kSuperSubBlocks * kSubScaleBytes +
           (b % kSuperSubBlocks) * layout_quant_bytes(Layout);
  } else {
    return panel + b * packed_block_bytes(Layout) + layout_scale_bytes(Layout);
  }
}

// A K-quant block's super-block, and its s0 bytes (s1: kPanelWidth further).
template <int Layout>
inline const uint8_t* super_of(const uint8_t* panel, int64_t b) {
  return panel + (b / kSuperSubBlocks) * super_block_bytes(Layout);
}
template <int Layout>
inline const uint8_t* sub_scales_of(const uint8_t* panel, int64_t b) {
  return super_of<Layout>(panel, b) + super_header_bytes(Layout) +
         (b % kSuperSubBlocks) * kSubScaleBytes;
}

#ifdef TURBO_CPU_X86
// The x86 vector operations of the block tile, on V::kLanes features at a time (16 in a
// zmm, 8 in a ymm: AVX2 runs a panel as two halves). dot4(acc, w, x) adds, per int32
// lane, the 4 products of w's unsigned bytes with x's 4 signed bytes: one vpdpbusd with
// VNNI; else vpmaddubsw + vpmaddwd, whose 16-bit pair sums saturate above 32767, so Wide
// weights (Q8_0's, up to 255) go as two nibble halves (the high one weighted 16 by vpmaddwd
// itself); 4- to 6-bit ones (at most 2 x 63 x 127) go whole.
template <int Lanes>
struct BlockOps;

template <>
struct BlockOps<16> {
  static constexpr int kLanes = 16;
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I zero() { return _mm512_setzero_si512(); }
  static I broadcast(int32_t v) { return _mm512_set1_epi32(v); }
  static I nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return nibbles(_mm512_srli_epi16(v, 4)); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  template <bool Wide>
  static I dot4(I acc, I w, I x) {
    if constexpr (kVnni) {
      return _mm512_dpbusd_epi32(acc, w, x);
    } else if constexpr (!Wide) {
      return add(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
    } else {
      const I low = _mm512_madd_epi16(_mm512_maddubs_epi16(nibbles(w), x), _mm512_set1_epi16(1));
      const I high = _mm512_madd_epi16(_mm512_maddubs_epi16(high_nibbles(w), x),
                                       _mm512_set1_epi16(16));
      return add(acc, add(low, high));
    }
  }
  static F load_halves(const uint8_t* p) {  // 16 fp16 values
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  template <bool Signed>
  static F load_bytes(const uint8_t* p) {  // 16 bytes as floats
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
  }
  static F zerof() { return _mm512_setzero_ps(); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F tofloat(I v) { return _mm512_cvtepi32_ps(v); }
  static F broadcastf(float v) { return _mm512_set1_ps(v); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};

template <>
struct BlockOps<8> {
  static constexpr int kLanes = 8;
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I broadcast(int32_t v) { return _mm256_set1_epi32(v); }
  static I nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return nibbles(_mm256_srli_epi16(v, 4)); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  template <bool Wide>
  static I dot4(I acc, I w, I x) {
    if constexpr (!Wide) {
      return add(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
    } else {
      const I low = _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles(w), x), _mm256_set1_epi16(1));
      const I high = _mm256_madd_epi16(_mm256_maddubs_epi16(high_nibbles(w), x),
                                       _mm256_set1_epi16(16));
      return add(acc, add(low, high));
    }
  }
  static F load_halves(const uint8_t* p) {  // 8 fp16 values
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  template <bool Signed>
  static F load_bytes(const uint8_t* p) {  // 8 bytes as floats
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
  }
  static F zerof() { return _mm256_setzero_ps(); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F tofloat(I v) { return _mm256_cvtepi32_ps(v); }
  static F broadcastf(float v) { return _mm256_set1_ps(v); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

// Features [lane0, lane0 + V::kLanes) of block b's scales: d0 (and Q6_K's second half's
// d1) and c (none for a symmetric layout), per block_layout.h.
template <typename V, int Layout>
inline void block_scales_x86(const uint8_t* panel, int64_t b, int lane0, typename V::F& d0,
                             typename V::F& d1, typename V::F& c) {
  if constexpr (Layout == kLayoutQ6K) {
    const typename V::F D = V::load_halves(super_of<Layout>(panel, b) + lane0 * 2);
    const uint8_t* s = sub_scales_of<Layout>(panel, b) + lane0;
    d0 = V::mul(D, V::template load_bytes<true>(s));
    d1 = V::mul(D, V::template load_bytes<true>(s + kPanelWidth));
  } else if constexpr (is_super_layout(Layout)) {
    const uint8_t* super = super_of<Layout>(panel, b);
    const uint8_t* s = sub_scales_of<Layout>(panel, b) + lane0;
    d0 = V::mul(V::load_halves(super + lane0 * 2), V::template load_bytes<false>(s));
    c = V::mul(V::load_halves(super + (kPanelWidth + lane0) * 2),
               V::template load_bytes<false>(s + kPanelWidth));
  } else {
    const uint8_t* block = panel + b * packed_block_bytes(Layout);
    d0 = V::load_halves(block + lane0 * 2);
    // A symmetric layout has no c: its zero point comes off the integer sums.
    if constexpr (layout_zero_point(Layout) == 0) {
      c = V::load_halves(block + (kPanelWidth + lane0) * 2);
    }
  }
}

// Features [lane0, lane0 + V::kLanes) of NP panels (panel, panel + panel_stride, ...)
// against MR rows: sums[p][r][lane0 + ..]. NP = 2 (many rows) loads each 4 activation
// bytes once for two panels: the broadcasts are a third of the tile's vector instructions.
template <typename V, int MR, int NP, int Layout>
inline void block_tile_x86(const QuantizedRows& x, int64_t m0, const uint8_t* panel,
                           int64_t panel_stride, int lane0,
                           float (&sums)[NP][MR][kPanelWidth]) {
  constexpr bool kWide = Layout == kLayoutQ8 || Layout == kLayoutQ8Z;  // quants up to 255
  constexpr bool kHalves = Layout == kLayoutQ6K;
  constexpr int32_t kZero = layout_zero_point(Layout);
  // Q6_K's two 16-input halves each finish their integer sums before the next starts, so
  // that a half takes no more registers than a whole block of the other layouts.
  constexpr int kParts = kHalves ? 2 : 1;
  constexpr int kPartGroups = 8 / kParts;  // groups of 4 inputs per part
  // Several integer accumulators per row when there are few rows (decode): each dot4
  // waits for the previous one into the same register.
  constexpr int kChains = MR * NP >= 4 ? 1 : (MR * NP >= 2 ? 2 : 4);
  typename V::F acc[NP][MR];
  for (int p = 0; p < NP; ++p) {
    for (int r = 0; r < MR; ++r) acc[p][r] = V::zerof();
  }
  const int byte0 = lane0 * 4;  // this half's features in each 64-byte group
  for (int64_t b = 0; b < x.blocks; ++b) {
    typename V::F d0[NP], d1[NP], c[NP];
    const uint8_t* q[NP];
    for (int p = 0; p < NP; ++p) {
      d1[p] = c[p] = V::zerof();
      block_scales_x86<V, Layout>(panel + p * panel_stride, b, lane0, d0[p], d1[p], c[p]);
      q[p] = block_quants<Layout>(panel + p * panel_stride, b) + byte0;
    }
    for (int part = 0; part < kParts; ++part) {
      typename V::I isum[kChains][NP][MR];
      for (int h = 0; h < kChains; ++h) {
        for (int p = 0; p < NP; ++p) {
          for (int r = 0; r < MR; ++r) isum[h][p][r] = V::zero();
        }
      }
      auto multiply = [&](int g, const typename V::I (&w)[NP]) __attribute__((always_inline)) {
        for (int r = 0; r < MR; ++r) {
          int32_t four;
          __builtin_memcpy(&four, x.q + (m0 + r) * x.K + b * kQuantBlock + 4 * g, 4);
          const typename V::I xb = V::broadcast(four);
          for (int p = 0; p < NP; ++p) {
            typename V::I& sum = isum[g % kChains][p][r];
            sum = V::template dot4<kWide>(sum, w[p], xb);
          }
        }
      };
      if constexpr (layout_quant_bits(Layout) == 8) {
        for (int g = part * kPartGroups; g < (part + 1) * kPartGroups; ++g) {
          typename V::I w[NP];
          for (int p = 0; p < NP; ++p) w[p] = V::load(q[p] + g * kGridBytes);
          multiply(g, w);
        }
      } else {
        for (int j = 0; j < 4; ++j) {
          typename V::I raw[NP], w[NP];
          for (int p = 0; p < NP; ++p) raw[p] = V::load(q[p] + j * kGridBytes);
          for (int p = 0; p < NP; ++p) w[p] = V::nibbles(raw[p]);
          multiply(j, w);
          for (int p = 0; p < NP; ++p) w[p] = V::high_nibbles(raw[p]);
          multiply(j + 4, w);
        }
      }
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (m0 + r) * x.blocks + b;
        const typename V::F dx = V::broadcastf(x.dx[at]);
        // sum (q - z) xq = sum q xq - z sum xq (Q6_K: z = 32, per half)
        const typename V::I zero_sum = V::broadcast(
            kHalves ? 32 * x.half_sums[2 * at + part]
                    : kZero * (x.half_sums[2 * at] + x.half_sums[2 * at + 1]));
        for (int p = 0; p < NP; ++p) {
          typename V::I total = isum[0][p][r];
          for (int h = 1; h < kChains; ++h) total = V::add(total, isum[h][p][r]);
          if constexpr (kHalves || kZero != 0) {
            total = V::sub(total, zero_sum);
            acc[p][r] = V::fma(V::tofloat(total), V::mul(part ? d1[p] : d0[p], dx), acc[p][r]);
          } else {
            acc[p][r] = V::fma(V::tofloat(total), V::mul(d0[p], dx), acc[p][r]);
            acc[p][r] = V::fma(c[p], V::broadcastf(x.sx[at]), acc[p][r]);
          }
        }
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    for (int r = 0; r < MR; ++r) V::store(sums[p][r] + lane0, acc[p][r]);
  }
}

// NP panels' 16 features, V::kLanes at a time.
template <int Lanes, int MR, int NP, int Layout>
inline void block_tile_lanes(const QuantizedRows& x, int64_t m0, const uint8_t* panel,
                             int64_t panel_stride, float (&sums)[NP][MR][kPanelWidth]) {
  for (int lane0 = 0; lane0 < kPanelWidth; lane0 += Lanes) {
    block_tile_x86<BlockOps<Lanes>, MR, NP, Layout>(x, m0, panel, panel_stride, lane0, sums);
  }
}
#endif

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  __builtin_memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Block b's scales for all 16 features, as block_scales_x86 (d1 and c zero where unused).
template <int Layout>
inline void block_scales_portable(const uint8_t* panel, int64_t b, float (&d0)[kPanelWidth],
                                  float (&d1)[kPanelWidth], float (&c)[kPanelWidth]) {
  for (int f = 0; f < kPanelWidth; ++f) {
    d1[f] = c[f] = 0.f;
    if constexpr (is_super_layout(Layout)) {
      const uint8_t* super = super_of<Layout>(panel, b);
      const uint8_t* s = sub_scales_of<Layout>(panel, b);
      const float D = half_at(super + 2 * f);
      if constexpr (Layout == kLayoutQ6K) {
        d0[f] = D * static_cast<float>(static_cast<int8_t>(s[f]));
        d1[f] = D * static_cast<float>(static_cast<int8_t>(s[kPanelWidth + f]));
      } else {
        d0[f] = D * static_cast<float>(s[f]);
        c[f] = half_at(super + 2 * (kPanelWidth + f)) * static_cast<float>(s[kPanelWidth + f]);
      }
    } else {
      const uint8_t* block = panel + b * packed_block_bytes(Layout);
      d0[f] = half_at(block + 2 * f);
      if constexpr (layout_zero_point(Layout) == 0) c[f] = half_at(block + 2 * (kPanelWidth + f));
    }
  }
}

// The portable form of block_tile's sums, one panel, for any CPU (the baseline build).
template <int MR, int Layout>
inline void block_tile_portable(const QuantizedRows& x, int64_t m0, const uint8_t* panel,
                                float (&sums)[MR][kPanelWidth]) {
  constexpr int kBits = layout_quant_bits(Layout);
  for (int r = 0; r < MR; ++r) {
    for (int f = 0; f < kPanelWidth; ++f) sums[r][f] = 0.f;
  }
  for (int64_t b = 0; b < x.blocks; ++b) {
    float d0[kPanelWidth], d1[kPanelWidth], c[kPanelWidth];
    block_scales_portable<Layout>(panel, b, d0, d1, c);
    const uint8_t* q = block_quants<Layout>(panel, b);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = x.q + (m0 + r) * x.K + b * kQuantBlock;
      int32_t isum[2][kPanelWidth] = {};  // inputs 0-15, 16-31
      for (int g = 0; g < 8; ++g) {
        for (int kk = 0; kk < 4; ++kk) {
          const int32_t xv = xq[4 * g + kk];
          for (int f = 0; f < kPanelWidth; ++f) {
            isum[g / 4][f] += grid_quant<kBits>(q, g, f, kk) * xv;
          }
        }
      }
      const int64_t at = (m0 + r) * x.blocks + b;
      const float dx = x.dx[at], sx = x.sx[at];
      for (int f = 0; f < kPanelWidth; ++f) {
        if constexpr (Layout == kLayoutQ6K) {
          for (int h = 0; h < 2; ++h) {
            const int32_t centred = isum[h][f] - 32 * x.half_sums[2 * at + h];
            sums[r][f] += static_cast<float>(centred) * ((h ? d1[f] : d0[f]) * dx);
          }
        } else if constexpr (layout_zero_point(Layout) != 0) {
          const int32_t centred = isum[0][f] + isum[1][f] -
                                  layout_zero_point(Layout) *
                                      (x.half_sums[2 * at] + x.half_sums[2 * at + 1]);
          sums[r][f] += static_cast<float>(centred) * (d0[f] * dx);
        } else {
          sums[r][f] += static_cast<float>(isum[0][f] + isum[1][f]) * (d0[f] * dx);
          sums[r][f] += c[f] * sx;
        }
      }
    }
  }
}

// sums[p][r][f] = x[m0 + r] . w[f] of panel p (at panel + p * panel_stride) for the 16
// features of NP panels, MR rows.
template <int MR, int NP, int Layout>
inline void block_tile(const QuantizedRows& x, int64_t m0, const uint8_t* panel,
                       int64_t panel_stride, float (&sums)[NP][MR][kPanelWidth]) {
#ifdef TURBO_CPU_X86
  if constexpr (kVectorWidth >= 8) {  // AVX2 and AVX-512 (with or without VNNI)
    block_tile_lanes<kVectorWidth, MR, NP, Layout>(x, m0, panel, panel_stride, sums);
    return;
  }
#endif
  for (int p = 0; p < NP; ++p) {
    block_tile_portable<MR, Layout>(x, m0, panel + p * panel_stride, sums[p]);
  }
}

// Rows per block tile: 8 fill AVX-512's registers (8 float + 8 int accumulators).
constexpr int kBlockTileRows = kVectorWidth == 16 ? 8 : 4;
// AVX-512 runs two panels per tile, kWideTileRows rows at a time (24 accumulators, the
// two panels' weights and one broadcast in its 32 registers), from kWideFromRows rows on:
// 6 rows x 2 panels take 12 activation broadcasts per group of 4 inputs where two 8 x 1
// tiles take 16, and the rows of a decode batch (16) tile evenly. Below 9 rows one panel
// per tile is faster: when the weights come from memory (every decode step), a 6 x 2 tile
// at 6 rows took 37 us on a Q4_1 1536 x 576 matrix against 26 us for the 8 x 1 tile,
// though both take 22 us on a matrix in cache (docs/benchmarks.md, 2026-12-03). The two
// panels are two short streams read side by side, which the hardware prefetcher seems to
// follow less well than one panel after another (not checked further).
constexpr int kWideTileRows = kVectorWidth == 16 ? 6 : 0;
constexpr int kWideFromRows = 9;

// Every row of x against NP panels, MR rows at a time (then fewer):
// store(p, m, sums) per panel p < NP and row m.
template <int MR, int NP, int Layout, typename Store>
inline void block_rows(const QuantizedRows& x, int64_t m_begin, int64_t m_end,
                       const uint8_t* panel, int64_t panel_stride, const Store& store) {
  int64_t m = m_begin;
  for (; m + MR <= m_end; m += MR) {
    float sums[NP][MR][kPanelWidth];
    block_tile<MR, NP, Layout>(x, m, panel, panel_stride, sums);
    for (int p = 0; p < NP; ++p) {
      for (int r = 0; r < MR; ++r) store(p, m + r, sums[p][r]);
    }
  }
  if constexpr (MR > 1) {
    if (m < m_end) block_rows<MR - 1, NP, Layout>(x, m, m_end, panel, panel_stride, store);
  }
}

// Panels [begin, end) against rows [m_begin, m_end): two panels per tile where there are
// kWideFromRows rows or more (AVX-512), else one. store(panel, m, sums).
template <int Layout, typename Store>
inline void block_panel_rows(const QuantizedRows& x, int64_t m_begin, int64_t m_end,
                             const uint8_t* packed, int64_t panel_stride, int64_t begin,
                             int64_t end, const Store& store) {
  const bool wide = kWideTileRows > 0 && m_end - m_begin >= kWideFromRows;
  for (int64_t p = begin; p < end;) {
    auto at = [&](int q, int64_t m, const float(&sums)[kPanelWidth]) { store(p + q, m, sums); };
    if constexpr (kWideTileRows > 0) {
      if (wide && p + 1 < end) {
        block_rows<kWideTileRows, 2, Layout>(x, m_begin, m_end, packed + p * panel_stride,
                                             panel_stride, at);
        p += 2;
        continue;
      }
    }
    block_rows<kBlockTileRows, 1, Layout>(x, m_begin, m_end, packed + p * panel_stride,
                                          panel_stride, at);
    p += 1;
  }
}

// Panels per parallel chunk: a few microseconds of work each (streaming ~20 bytes/ns).
inline int64_t block_panels_grain(int64_t panel_bytes, int64_t M) {
  const double ns = static_cast<double>(panel_bytes) * (1 + M / 4) / 20;
  return std::max<int64_t>(1, static_cast<int64_t>(8000 / ns));
}

// out[m, n] = x[m] . w[n] (+ bias[n]) for n < N; K a multiple of 32. In parallel over
// panels, the rows in blocks whose quantized activations stay in L2. argmax: as in
// linear_rows.
template <int Layout, typename Out>
void block_linear_rows(Out* out, int64_t out_stride, const float* x, int64_t x_stride,
                       int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                       const Out* bias, int64_t* argmax) {
  const QuantizedRows xq = quantize_activations(x, x_stride, M, K);
  const int64_t panel_stride = (K / kQuantBlock) * packed_block_bytes(Layout);
  const int64_t num_panels = (N + kPanelWidth - 1) / kPanelWidth;
  const int64_t row_block = std::max<int64_t>(64, (256 * 1024) / std::max<int64_t>(1, K));
  RowArgmax row_argmax(argmax, M);
  parallel_for(0, num_panels, block_panels_grain(panel_stride, M),
               [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t m1 = std::min(M, m0 + row_block);
      block_panel_rows<Layout>(xq, m0, m1, packed, panel_stride, begin, end,
                               [&](int64_t p, int64_t m, const float(&sums)[kPanelWidth]) {
        const int64_t n0 = p * kPanelWidth;
        const int64_t count = std::min<int64_t>(kPanelWidth, N - n0);
        store_sums(out + m * out_stride + n0, sums, count, nullptr, bias ? bias + n0 : nullptr);
      });
    }
    row_argmax.scan(out, out_stride, 0, M, begin * kPanelWidth, std::min(N, end * kPanelWidth));
  });
  if (argmax) row_argmax.finish();
}

// out[m, j] = silu(x[m] . gate[j]) * (x[m] . up[j]) for j < I, gate_up packed in two
// groups (gate's panels, then up's), as linear_silu_mul_rows.
template <int Layout, typename Out>
void block_linear_silu_mul_rows(Out* out, int64_t out_stride, const float* x,
                                int64_t x_stride, int64_t M, int64_t K, const uint8_t* packed,
                                int64_t I) {
  const QuantizedRows xq = quantize_activations(x, x_stride, M, K);
  const int64_t panel_stride = (K / kQuantBlock) * packed_block_bytes(Layout);
  const int64_t group_panels = (I + kPanelWidth - 1) / kPanelWidth;
  const int64_t row_block = std::max<int64_t>(64, (256 * 1024) / std::max<int64_t>(1, K));
  parallel_for(0, group_panels, block_panels_grain(2 * panel_stride, M),
               [&](int64_t begin, int64_t end) {
    // Two panels' gate sums at a time (block_panel_rows' wide tile), then their up sums.
    const int64_t rows = std::min(M, row_block);
    std::vector<float> gate(2 * rows * kPanelWidth);
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t m1 = std::min(M, m0 + row_block);
      for (int64_t p = begin; p < end; p += 2) {
        const int64_t p_end = std::min(end, p + 2);
        block_panel_rows<Layout>(
            xq, m0, m1, packed, panel_stride, p, p_end,
            [&](int64_t panel, int64_t m, const float(&sums)[kPanelWidth]) {
              std::copy(sums, sums + kPanelWidth,
                        gate.data() + ((panel - p) * rows + m - m0) * kPanelWidth);
            });
        block_panel_rows<Layout>(
            xq, m0, m1, packed, panel_stride, group_panels + p, group_panels + p_end,
            [&](int64_t panel, int64_t m, const float(&up_sums)[kPanelWidth]) {
              const int64_t j0 = (panel - group_panels) * kPanelWidth;
              const int64_t count = std::min<int64_t>(kPanelWidth, I - j0);
              const float* gate_sums =
                  gate.data() + ((panel - group_panels - p) * rows + m - m0) * kPanelWidth;
              Out* o = out + m * out_stride + j0;
              for (int64_t c = 0; c < count; ++c) {
                // As linear_silu_mul_rows: gate and up rounded, silu(gate) rounded.
                const float g = static_cast<float>(round_to<Out>(gate_sums[c]));
                const float u = static_cast<float>(round_to<Out>(up_sums[c]));
                o[c] = round_to<Out>(static_cast<float>(round_to<Out>(silu(g))) * u);
              }
            });
      }
    }
  });
}
