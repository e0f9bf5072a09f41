// turbo's CPU kernels over raw rows, written once and compiled once per instruction set:
// cpu_kernels.cpp includes this file inside namespaces turbo::cpu::avx512 / avx2 /
// portable, each under its own target pragma, after defining in that namespace
//   kVectorWidth  floats in one vector register (16, 8 or 4),
//   kTileRows     rows of x and kTilePanels weight panels in one linear tile (sized so
//                 the tile's accumulators and loads fit the register file),
// and kPanelWidth (cpu_kernels.cpp) is the width of a packed weight panel.
// No include guard and no includes here: the headers are included before the pragmas,
// so nothing outside these namespaces is compiled for a wider instruction set.
//
// Arithmetic is fp32 whatever the storage type; a value transformers rounds to the
// model dtype between two ops (the residual sum, the normalised row, silu(gate), each
// linear's output) is rounded here at the same place, so bf16 results follow it closely.
// Loops split across threads with parallel_for (cpu/thread_pool.h) only when there is
// enough work to pay for waking the threads.

// ---------------------------------------------------------------------------------
// Vectors: GCC/Clang vector extensions, lowered to the registers of the target (one
// zmm, one ymm, or an SSE/NEON register).

typedef float FloatVec __attribute__((vector_size(kVectorWidth * sizeof(float))));
typedef uint16_t Bits16Vec __attribute__((vector_size(kVectorWidth * sizeof(uint16_t))));
typedef uint32_t Bits32Vec __attribute__((vector_size(kVectorWidth * sizeof(uint32_t))));
typedef int8_t Int8Vec __attribute__((vector_size(kVectorWidth * sizeof(int8_t))));
typedef int16_t Int16Vec __attribute__((vector_size(kVectorWidth * sizeof(int16_t))));
typedef int32_t Int32Vec __attribute__((vector_size(kVectorWidth * sizeof(int32_t))));

inline FloatVec load_vec(const float* p) {
  FloatVec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// bf16 is the top half of an fp32: widen and shift.
inline FloatVec load_vec(const c10::BFloat16* p) {
  Bits16Vec half;
  __builtin_memcpy(&half, p, sizeof(half));
  const Bits32Vec bits = __builtin_convertvector(half, Bits32Vec) << 16;
  FloatVec v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}

// int8 weights (quantization=int8): sign-extended to int32 lanes, then converted to fp32,
// in registers. The per-output scale is applied to the finished sums (linear_rows).
// GCC lowers a vector conversion from int8 lane by lane, so x86 uses its one-instruction
// widening (vpmovsxbd). A template whose conditions name its parameter, so that only
// this namespace's branch is instantiated (AVX-512 code never lands in the AVX2 build).
template <typename Int8, std::enable_if_t<std::is_same_v<Int8, int8_t>, int> = 0>
inline FloatVec load_vec(const Int8* p) {
#ifdef TURBO_CPU_X86
  if constexpr (sizeof(Int8) == 1 && kVectorWidth == 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));  // 16 weights
    return reinterpret_cast<FloatVec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
  } else if constexpr (sizeof(Int8) == 1 && kVectorWidth == 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));  // 8 weights
    return reinterpret_cast<FloatVec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
  }
#endif
  Int8Vec q;
  __builtin_memcpy(&q, p, sizeof(q));
  // Through int16: one step (int8 to int32) would be converted lane by lane.
  return __builtin_convertvector(
      __builtin_convertvector(__builtin_convertvector(q, Int16Vec), Int32Vec), FloatVec);
}

// The sum of a vector's lanes, by halving (log2 width shuffles and adds). A template so
// that only the branch of this vector width is instantiated.
template <typename Vec>
inline float reduce_add(Vec v) {
  constexpr int kWidth = sizeof(Vec) / sizeof(float);
  if constexpr (kWidth == 16) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  } else if constexpr (kWidth == 8) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  } else {
    static_assert(kWidth == 4);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2);
  }
  return v[0];
}

// The lane sums of four vectors at once: the vectors are folded into each other, so the
// four sums cost about as much as one.
template <typename Vec>
inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float (&sums)[4]) {
  constexpr int kWidth = sizeof(Vec) / sizeof(float);
  if constexpr (kWidth == 16) {
    // Halves: a's pair sums in lanes 0-7 and b's in 8-15 (c, d likewise).
    const Vec ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                                20, 21, 22, 23) +
                        __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                                27, 28, 29, 30, 31);
    const Vec cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                                20, 21, 22, 23) +
                        __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                                27, 28, 29, 30, 31);
    // Quarters: a in lanes 0-3, b in 4-7, c in 8-11, d in 12-15.
    Vec t = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                                         25, 26, 27) +
                 __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                         29, 30, 31);
    t += __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    t += __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    sums[0] = t[0], sums[1] = t[4], sums[2] = t[8], sums[3] = t[12];
  } else if constexpr (kWidth == 8) {
    const Vec ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                        __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    const Vec cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                        __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    Vec t = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
    t += __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6);
    sums[0] = t[0], sums[1] = t[2], sums[2] = t[4], sums[3] = t[6];
  } else {
    static_assert(kWidth == 4);
    const Vec ab =
        __builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7);
    const Vec cd =
        __builtin_shufflevector(c, d, 0, 1, 4, 5) + __builtin_shufflevector(c, d, 2, 3, 6, 7);
    const Vec t = __builtin_shufflevector(ab, cd, 0, 2, 4, 6) +
                       __builtin_shufflevector(ab, cd, 1, 3, 5, 7);
    sums[0] = t[0], sums[1] = t[1], sums[2] = t[2], sums[3] = t[3];
  }
}

// Bytes and floats in a cache line, and a float buffer whose start is on one.
constexpr int64_t kLineBytes = 64, kLineFloats = kLineBytes / sizeof(float);
inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }
inline float* aligned_floats(std::vector<float>& buffer, int64_t count) {
  buffer.resize(count + kLineFloats);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  const auto aligned = static_cast<uintptr_t>(round_up(static_cast<int64_t>(address), kLineBytes));
  return buffer.data() + (aligned - address) / sizeof(float);
}

// Asks for `count` rows of `width` elements, `stride` elements apart, into L2 ahead of
// their use. Attention reads a sequence's cache in short runs (a block's part of one kv
// head, or one sequence's rows), each starting a stream the hardware prefetcher meets
// cold and drops at every page; so each pass asks for what the next one reads.
template <typename T>
inline void prefetch_rows(const T* rows, int64_t count, int64_t stride, int64_t width) {
  constexpr int64_t line = kLineBytes / sizeof(T);
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t e = 0; e < width; e += line) __builtin_prefetch(rows + r * stride + e, 0, 2);
  }
}

// The keys query row t of sequence b sees, causally: those before its own position, and
// itself (0 or less: a padding row).
inline int64_t keys_seen(const int32_t* query_start_loc, const int32_t* context_lens, int64_t b,
                         int64_t t) {
  return context_lens[b] - (query_start_loc[b + 1] - t) + 1;
}

// Elements of work below which one thread does it all: waking a thread and handing it
// work costs a few microseconds, as much as a thread computes in that time.
constexpr int64_t kMinWorkPerThread = 1 << 16;

inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(1, work_per_item));
}

template <typename scalar_t>
inline scalar_t round_to(float value) {
  return static_cast<scalar_t>(value);
}


// exp(x) for the softmax numerators (x <= 0), written so the compiler vectorises the
// loop around it (libm's expf is a call per element): x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by Cephes' degree-6 polynomial, 2^n put straight into the exponent bits.
// Relative error below 2e-7, the size of fp32 rounding. Always inlined: called out of line
// (as GCC chose for the MLP's silu epilogues) it costs a call per element, unvectorised.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // below this 2^n leaves the normal range; exp is ~0 anyway
  constexpr float kRoundingShift = 12582912.f;  // 1.5 * 2^23: adding it rounds to integer
  const float shifted = x * 1.44269504088896341f + kRoundingShift;
  const float n = shifted - kRoundingShift;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  bits = (bits - 0x4B400000 + 127) << 23;  // the integer n, as a float exponent
  float two_to_n;
  std::memcpy(&two_to_n, &bits, sizeof(two_to_n));
  return p * two_to_n;
}

// silu(x) = x * sigmoid(x), with e = exp(-|x|) <= 1 so that it never overflows:
// sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below. Branch-free, so a loop of
// silu vectorises (libm's expf is a call per element).
__attribute__((always_inline)) inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  return x * ((x >= 0.f ? 1.f : e) / (1.f + e));
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  int64_t i = 0;
  if (n >= kVectorWidth) {
    FloatVec acc = {};
    for (; i + kVectorWidth <= n; i += kVectorWidth) acc += load_vec(a + i) * load_vec(b + i);
    sum = reduce_add(acc);
  }
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// The largest and the sum of n floats, a vector at a time (a scalar loop would be one
// dependent chain: the compiler may not reorder float sums).
inline float max_of(const float* x, int64_t n) {
  float result = x[0];
  int64_t i = 0;
  if (n >= kVectorWidth) {
    FloatVec best = load_vec(x);
    for (i = kVectorWidth; i + kVectorWidth <= n; i += kVectorWidth) {
      const FloatVec v = load_vec(x + i);
      best = best > v ? best : v;
    }
    for (int l = 0; l < kVectorWidth; ++l) result = std::max(result, best[l]);
  }
  for (; i < n; ++i) result = std::max(result, x[i]);
  return result;
}

inline float sum_of(const float* x, int64_t n) {
  float sum = 0.f;
  int64_t i = 0;
  if (n >= kVectorWidth) {
    FloatVec acc = {};
    for (; i + kVectorWidth <= n; i += kVectorWidth) acc += load_vec(x + i);
    sum = reduce_add(acc);
  }
  for (; i < n; ++i) sum += x[i];
  return sum;
}

// ---------------------------------------------------------------------------------
// Linear layers: out = x @ w^T for the checkpoint's w [N, K], packed once at load into
// panels of kPanelWidth output features: packed[p][k][c] = w[p * kPanelWidth + c][k]
// (pack_linear_weight in kernels.h; the last panel is zero-padded).
//
// A tile is MR rows of x against NP panels: each k broadcasts MR values of x and loads NP
// panel rows (contiguous), and MR x NP x kPanelWidth accumulators stay in registers, so
// no horizontal sums are needed. Threads split the panels, so each streams its own slice
// of the weights from memory exactly once per step for all the step's rows (decode:
// every sequence at once). For many rows (prefill) the rows go in blocks that fit in L2.
// The weight type is a template parameter: fp32, bf16, or int8 (quantization=int8) with
// a float32 scale per output feature, applied once to each finished sum in the store, so
// the k loop is the same multiply-add whatever the weights (load_vec widens them).

constexpr int kPanelVecs = kPanelWidth / kVectorWidth;  // vector registers per panel row

// A multiply-add waits for the previous one into the same accumulator (4 cycles on
// current x86): a tile with fewer accumulators than this (a few rows: decode) would wait
// on them instead of streaming its weights, so it keeps several sets, one per k in turn.
constexpr int kMinAccumulators = 8;

// Cache lines of the next tile's panels that a tile asks for while it computes (see
// panel_tiles): lines [first, first + count) of each of `panels`; none where count is 0.
template <int NP>
struct PanelLines {
  const char* panels[NP];
  int64_t first = 0, count = 0;

  // Line `line` of each panel into L2 (prefetcht1), not L1, which holds this tile's.
  __attribute__((always_inline)) void ask(int64_t line) const {
    for (int p = 0; p < NP; ++p) __builtin_prefetch(panels[p] + line * kLineBytes, 0, 2);
  }
};

// sums[r][j] for rows r < MR and columns j < NP * kPanelWidth of the panels `panels`,
// asking for ahead's lines on the way.
template <int MR, int NP, typename W>
inline void panel_tile(const float* x, int64_t x_stride, const W* const (&panels)[NP], int64_t K,
                       float (&sums)[MR][NP * kPanelWidth], const PanelLines<NP>& ahead) {
  constexpr int kAccumulators = MR * NP * kPanelVecs;
  constexpr int kChains = std::max(1, kMinAccumulators / kAccumulators);
  FloatVec acc[kChains][MR][NP * kPanelVecs] = {};
  auto step = [&](FloatVec (&a)[MR][NP * kPanelVecs], int64_t k) __attribute__((always_inline)) {
    FloatVec w[NP * kPanelVecs];
    for (int p = 0; p < NP; ++p) {
      for (int v = 0; v < kPanelVecs; ++v) {
        w[p * kPanelVecs + v] = load_vec(panels[p] + k * kPanelWidth + v * kVectorWidth);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const float xr = x[r * x_stride + k];
      for (int j = 0; j < NP * kPanelVecs; ++j) a[r][j] += w[j] * xr;
    }
  };
  // ahead's lines spread evenly over the k loop: `owed` counts in 1/K lines.
  int64_t line = ahead.first, owed = 0;
  const int64_t end_line = ahead.first + ahead.count;
  int64_t k = 0;
  for (; k + kChains <= K; k += kChains) {
    for (int c = 0; c < kChains; ++c) step(acc[c], k + c);
    for (owed += ahead.count * kChains; owed >= K && line < end_line; owed -= K) {
      ahead.ask(line++);
    }
  }
  for (; k < K; ++k) step(acc[0], k);
  while (line < end_line) ahead.ask(line++);
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NP * kPanelVecs; ++j) {
      for (int c = 1; c < kChains; ++c) acc[0][r][j] += acc[c][r][j];
      __builtin_memcpy(&sums[r][j * kVectorWidth], &acc[0][r][j], sizeof(FloatVec));
    }
  }
}

// Rows [m_begin, m_end) of x against the NP panels, MR rows at a time (then fewer):
// store(row, sums) per row. Each row tile asks for its share of ahead's lines.
template <int MR, int NP, typename W, typename Store>
inline void rows_against_panels(const float* x, int64_t x_stride, int64_t m_begin,
                                int64_t m_end, int64_t K, const W* const (&panels)[NP],
                                const Store& store, PanelLines<NP> ahead) {
  int64_t m = m_begin;
  const int64_t row_tiles = (m_end - m_begin + MR - 1) / MR;
  const int64_t end_line = ahead.first + ahead.count;
  const int64_t per_tile = (ahead.count + row_tiles - 1) / row_tiles;
  for (; m + MR <= m_end; m += MR) {
    float sums[MR][NP * kPanelWidth];
    ahead.count = std::min(per_tile, end_line - ahead.first);
    panel_tile<MR, NP>(x + m * x_stride, x_stride, panels, K, sums, ahead);
    ahead.first += ahead.count;
    for (int r = 0; r < MR; ++r) store(m + r, sums[r]);
  }
  if constexpr (MR > 1) {
    ahead.count = end_line - ahead.first;
    if (m < m_end) {
      rows_against_panels<MR - 1, NP>(x, x_stride, m, m_end, K, panels, store, ahead);
    }
  }
}

// Tiles [tile_begin, tile_end) of NP panels each against rows [m_begin, m_end) of x, the
// rows in blocks that stay in L2 while a tile's panels are read from L1/L2.
// A tile's first row tile reads its panels from memory, and its multiply-adds wait on
// them: at a decode batch of 16-64 rows that wait cost a fifth to a quarter of the
// products' time. So each tile asks for the next tile's panels (into L2) while its row
// tiles compute, a share per row tile. One row tile (up to kTileRows rows) has nothing
// to hide the fetch behind, and asking cost it 3-8 % (docs/benchmarks.md): it asks none.
// tile_panels(tile, panels) fills a tile's panel pointers; store(m, tile, sums).
template <int NP, typename W, typename TilePanels, typename Store>
inline void panel_tiles(const float* x, int64_t x_stride, int64_t m_begin, int64_t m_end,
                        int64_t K, int64_t tile_begin, int64_t tile_end,
                        const TilePanels& tile_panels, const Store& store) {
  constexpr int64_t kRowBlockBytes = 256 * 1024;
  const int64_t row_block = std::max<int64_t>(
      kTileRows, kRowBlockBytes / (K * int64_t{sizeof(float)}) / kTileRows * kTileRows);
  const int64_t panel_bytes = K * kPanelWidth * int64_t{sizeof(W)};
  const int64_t panel_lines = round_up(panel_bytes, kLineBytes) / kLineBytes;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += row_block) {
    const int64_t m1 = std::min(m_end, m0 + row_block);
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      const W* panels[NP];
      tile_panels(tile, panels);
      PanelLines<NP> ahead;
      if (tile + 1 < tile_end && m1 - m0 > kTileRows) {
        const W* next[NP];
        tile_panels(tile + 1, next);
        for (int p = 0; p < NP; ++p) ahead.panels[p] = reinterpret_cast<const char*>(next[p]);
        ahead.count = panel_lines;
      }
      rows_against_panels<kTileRows, NP>(
          x, x_stride, m0, m1, K, panels,
          [&](int64_t m, const float(&sums)[NP * kPanelWidth]) { store(m, tile, sums); }, ahead);
    }
  }
}

// How long a tile of `panels` panels takes against M rows of K inputs, in ns, estimated
// from the weight bytes it streams (about 20 per ns on one core) and the multiply-adds it
// does (about 64 per ns).
template <typename W>
inline double tile_ns(int64_t K, int64_t M, int64_t panels) {
  const double weights = static_cast<double>(panels * kPanelWidth * K);
  return std::max(weights * sizeof(W) / 20, weights * M / 64);
}

// body(m_begin, m_end, tile_begin, tile_end) over `tiles` tiles of `panels` panels each
// against all M rows of K inputs, in parallel. Threads split the tiles, so each streams
// its own slice of the weights once for all the step's rows (decode: every sequence at
// once). Where the tiles are fewer than the pool's chunks and the rows many (a prefill
// through a narrow matrix: stories260K's qkv is 4 tiles, o_proj and down 2), the rows are
// cut into slices too, else the loop has one chunk a tile and most threads wait: its
// prefill's qkv ran as fast on two threads as on one. A chunk takes several microseconds
// (claiming one and waking a thread for it costs about one).
template <typename W, typename Body>
inline void parallel_tiles(int64_t tiles, int64_t M, int64_t K, int64_t panels,
                           const Body& body) {
  constexpr double kMinChunkNs = 8000;
  const int64_t row_tiles = (M + kTileRows - 1) / kTileRows;
  int64_t slices = 1;
  if (tiles < max_chunks()) {
    const int64_t by_work = static_cast<int64_t>(tile_ns<W>(K, M, panels) / kMinChunkNs);
    slices = std::clamp<int64_t>((max_chunks() + tiles - 1) / tiles, 1,
                                 std::max<int64_t>(1, std::min(row_tiles, by_work)));
  }
  const int64_t slice_rows = (row_tiles + slices - 1) / slices * kTileRows;
  slices = (M + slice_rows - 1) / slice_rows;
  const int64_t grain = std::max<int64_t>(
      1, static_cast<int64_t>(kMinChunkNs / tile_ns<W>(K, slice_rows, panels)));
  // Items slice by slice, so a chunk's tiles reuse its rows of x from the cache.
  parallel_for(0, slices * tiles, grain, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t slice = begin / tiles, tile = begin % tiles;
      const int64_t tile_end = std::min(tiles, tile + (end - begin));
      body(slice * slice_rows, std::min(M, (slice + 1) * slice_rows), tile, tile_end);
      begin += tile_end - tile;
    }
  });
}

// Lanes (i + Shift) mod L of v.
using VectorLanes = std::make_integer_sequence<int, kVectorWidth>;
template <int Shift, typename Vec, int... I>
inline Vec rotate_lanes(Vec v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(v, v, ((I + Shift) % kVectorWidth)...);
}

// Each lane of v (a vector of kVectorWidth lanes) combined by `op` with the lanes Step,
// 2 Step, 4 Step ... away: with Step 1, op over all lanes, in every lane; with Step H,
// op over the lanes equal mod H.
template <int Step, typename Vec, typename Op>
inline Vec fold_lanes(Vec v, Op op) {
  if constexpr (Step < kVectorWidth) {
    return fold_lanes<2 * Step>(op(v, rotate_lanes<Step>(v, VectorLanes{})), op);
  } else {
    return v;
  }
}

// Whether any lane of a comparison's result is set.
inline bool any_lane(Int32Vec v) {
  return fold_lanes<1>(v, [](Int32Vec a, Int32Vec b) { return a | b; })[0] != 0;
}

// Each row's first largest output of a linear (the LM head of a step whose every row is
// greedy: kernels.h, linear with `argmax`), taken by each parallel chunk over the columns
// it has just written, while they are in its core's cache: an argmax after the call would
// read every row back from the caches of whichever cores wrote it, which cost more than
// the argmax itself. Chunks merge their rows' bests under a lock (a loop has a few chunks
// per thread). NaN counts as the largest, as in torch.argmax and numpy.argmax.
class RowArgmax {
  struct Best {
    float value = -INFINITY;
    int64_t index = -1;  // none yet
  };

 public:
  // ids: int64 [rows] to fill (finish); null: no argmax wanted, and scan does nothing.
  RowArgmax(int64_t* ids, int64_t rows) : ids_(ids), rows_(ids ? rows : 0), best_(rows_) {}

  // Columns [n_begin, n_end) of rows [m_begin, m_end) of out were just written by this
  // thread.
  template <typename Out>
  void scan(const Out* out, int64_t out_stride, int64_t m_begin, int64_t m_end,
            int64_t n_begin, int64_t n_end) {
    m_end = std::min(m_end, rows_);
    if (m_begin >= m_end || n_begin >= n_end) return;
    std::vector<Best> found(m_end - m_begin);
    for (int64_t m = m_begin; m < m_end; ++m) {
      found[m - m_begin] = segment_best(out + m * out_stride, n_begin, n_end);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t m = m_begin; m < m_end; ++m) {
      const Best& mine = found[m - m_begin];
      if (best_[m].index < 0 || better(mine, best_[m])) best_[m] = mine;
    }
  }

  // Writes each row's index; after every chunk has scanned.
  void finish() {
    for (int64_t m = 0; m < rows_; ++m) ids_[m] = best_[m].index;
  }

 private:
  // The first largest of row[n_begin, n_end), in one pass: each lane keeps its largest
  // value and where it was (a strictly larger value moves it, so the first stays), NaN
  // lanes are flagged apart (a compare skips them), then the lanes and the tail combine.
  template <typename Out>
  static Best segment_best(const Out* row, int64_t n_begin, int64_t n_end) {
    Best best;
    Int32Vec nan{};
    int64_t n = n_begin;
    if (n_end - n_begin >= kVectorWidth) {
      Int32Vec index, where;
      for (int lane = 0; lane < kVectorWidth; ++lane) index[lane] = static_cast<int32_t>(n + lane);
      FloatVec top = FloatVec{} - INFINITY;
      where = index;
      for (; n + kVectorWidth <= n_end; n += kVectorWidth) {
        const FloatVec v = load_vec(row + n);
        const Int32Vec larger = v > top;
        top = larger ? v : top;
        where = larger ? index : where;
        nan |= v != v;
        index += kVectorWidth;
      }
      // The largest lane, then the first column among the lanes that hold it, without a
      // branch per lane: a chunk scans only a few dozen columns of each row where the
      // vocabulary is small (512 in stories260K, over 8 chunks).
      const FloatVec largest =
          fold_lanes<1>(top, [](FloatVec a, FloatVec b) { return a > b ? a : b; });
      const Int32Vec candidates = top == largest ? where : Int32Vec{} + INT32_MAX;
      best = {largest[0],
              fold_lanes<1>(candidates, [](Int32Vec a, Int32Vec b) { return a < b ? a : b; })[0]};
    }
    bool has_nan = any_lane(nan);
    for (; n < n_end; ++n) {
      const float v = static_cast<float>(row[n]);
      if (best.index < 0 || v > best.value) best = {v, n};
      has_nan |= v != v;
    }
    if (has_nan) {  // rare: the first NaN is the answer
      for (n = n_begin; n < n_end && row[n] == row[n]; ++n) {
      }
      best = {NAN, n};
    }
    return best;
  }

  // a before b: a NaN first, then the larger value, then the smaller index.
  static bool better(const Best& a, const Best& b) {
    const bool a_nan = a.value != a.value, b_nan = b.value != b.value;
    if (a_nan != b_nan) return a_nan;
    if (!a_nan && a.value != b.value) return a.value > b.value;
    return a.index < b.index;
  }

  int64_t* ids_;
  int64_t rows_;
  std::vector<Best> best_;
  std::mutex mutex_;
};

// o[c] = sums[c] * scale[c] + bias[c], rounded to the output type, for c < count; scale
// and bias may be null (none). Each case is a loop of its own, without a pointer test
// inside: GCC if-converts `scale ? sums[c] * scale[c] : sums[c]` into AVX-512 loads
// masked by the test, through the null pointer, and each such load (every lane off, on an
// unmapped page) takes a fault-suppression assist of hundreds of cycles: the fp32 MLP's
// silu_mul ran at a fifth of its int8 twin's speed on the 2-core AMD test machine.
template <typename Out>
inline void store_sums(Out* o, const float* sums, int64_t count, const float* scale,
                       const Out* bias) {
  if (scale && bias) {
    for (int64_t c = 0; c < count; ++c) {
      o[c] = round_to<Out>(sums[c] * scale[c] + static_cast<float>(bias[c]));
    }
  } else if (scale) {
    for (int64_t c = 0; c < count; ++c) o[c] = round_to<Out>(sums[c] * scale[c]);
  } else if (bias) {
    for (int64_t c = 0; c < count; ++c) {
      o[c] = round_to<Out>(sums[c] + static_cast<float>(bias[c]));
    }
  } else {
    for (int64_t c = 0; c < count; ++c) o[c] = round_to<Out>(sums[c]);
  }
}

// out[m, n] = x[m] . w[n] * scale[n] (+ bias[n]) for n < N, rounded to the output type.
// scale (int8 weights only, else null) is packed like the weight: one per panel column.
// argmax (int64 [M], or null): each row's first largest output (RowArgmax).
template <typename W, typename Out>
void linear_rows(Out* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t M,
                 int64_t K, const W* packed, int64_t N, const Out* bias, const float* scale,
                 int64_t* argmax) {
  const int64_t panel_elems = K * kPanelWidth;
  const int64_t num_panels = (N + kPanelWidth - 1) / kPanelWidth;
  auto store = [&](int64_t m, int64_t first_panel, const float* sums, int panels) {
    const int64_t n0 = first_panel * kPanelWidth;
    const int64_t count = std::min<int64_t>(panels * kPanelWidth, N - n0);
    store_sums(out + m * out_stride + n0, sums, count, scale ? scale + n0 : nullptr,
               bias ? bias + n0 : nullptr);
  };
  RowArgmax row_argmax(argmax, M);
  const int64_t tile_width = kTilePanels * kPanelWidth;
  // Whole tiles of kTilePanels panels, and the panels left over as one tile of its own.
  const int64_t full_tiles = num_panels / kTilePanels;
  const int64_t tiles = (num_panels + kTilePanels - 1) / kTilePanels;
  parallel_tiles<W>(tiles, M, K, kTilePanels, [&](int64_t m_begin, int64_t m_end,
                                                  int64_t tile_begin, int64_t tile_end) {
    panel_tiles<kTilePanels, W>(
        x, x_stride, m_begin, m_end, K, tile_begin, std::min(tile_end, full_tiles),
        [&](int64_t tile, const W*(&panels)[kTilePanels]) {
          for (int p = 0; p < kTilePanels; ++p) {
            panels[p] = packed + (tile * kTilePanels + p) * panel_elems;
          }
        },
        [&](int64_t m, int64_t tile, const float(&sums)[kTilePanels * kPanelWidth]) {
          store(m, tile * kTilePanels, sums, kTilePanels);
        });
    if (tile_end > full_tiles) {
      panel_tiles<1, W>(
          x, x_stride, m_begin, m_end, K, full_tiles * kTilePanels, num_panels,
          [&](int64_t panel, const W*(&panels)[1]) { panels[0] = packed + panel * panel_elems; },
          [&](int64_t m, int64_t panel, const float(&sums)[kPanelWidth]) {
            store(m, panel, sums, 1);
          });
    }
    row_argmax.scan(out, out_stride, m_begin, m_end, tile_begin * tile_width,
                    std::min(N, tile_end * tile_width));
  });
  if (argmax) row_argmax.finish();
}

// out[m, j] = silu(x[m] . gate[j]) * (x[m] . up[j]) for j < I, from gate_up packed in two
// groups (gate's panels, then up's): the MLP's first linear and its activation in one
// pass, without an [M, 2I] buffer. A tile is one gate panel and the matching up panel.
// scale: as in linear_rows, packed in the same two groups.
template <typename W, typename Out>
void linear_silu_mul_rows(Out* out, int64_t out_stride, const float* x, int64_t x_stride,
                          int64_t M, int64_t K, const W* packed, int64_t I,
                          const float* scale) {
  const int64_t panel_elems = K * kPanelWidth;
  const int64_t group_panels = (I + kPanelWidth - 1) / kPanelWidth;
  parallel_tiles<W>(group_panels, M, K, 2, [&](int64_t m_begin, int64_t m_end,
                                                int64_t tile_begin, int64_t tile_end) {
    panel_tiles<2, W>(
        x, x_stride, m_begin, m_end, K, tile_begin, tile_end,
        [&](int64_t panel, const W*(&panels)[2]) {
          panels[0] = packed + panel * panel_elems;
          panels[1] = packed + (group_panels + panel) * panel_elems;
        },
        [&](int64_t m, int64_t panel, const float(&sums)[2 * kPanelWidth]) {
          const int64_t j0 = panel * kPanelWidth;
          const int64_t count = std::min<int64_t>(kPanelWidth, I - j0);
          const float* gate_sums = sums;
          const float* up_sums = sums + kPanelWidth;
          float scaled[2 * kPanelWidth];
          if (scale) {  // int8 weights: their channels' scales, in a loop of their own (store_sums)
            const float* gate_scale = scale + j0;
            const float* up_scale = scale + (group_panels + panel) * kPanelWidth;
            for (int64_t c = 0; c < count; ++c) {
              scaled[c] = sums[c] * gate_scale[c];
              scaled[kPanelWidth + c] = sums[kPanelWidth + c] * up_scale[c];
            }
            gate_sums = scaled;
            up_sums = scaled + kPanelWidth;
          }
          Out* o = out + m * out_stride + j0;
          for (int64_t c = 0; c < count; ++c) {
            // As transformers in the model dtype: gate and up rounded, silu(gate) rounded.
            const float gate = static_cast<float>(round_to<Out>(gate_sums[c]));
            const float up = static_cast<float>(round_to<Out>(up_sums[c]));
            const float act = static_cast<float>(round_to<Out>(silu(gate)));
            o[c] = round_to<Out>(act * up);
          }
        });
  });
}

// ---------------------------------------------------------------------------------
// RMSNorm, optionally with the residual add fused in front.

template <typename scalar_t>
void rms_norm_rows(scalar_t* out, int64_t out_stride, const scalar_t* x, int64_t x_stride,
                   scalar_t* residual, int64_t residual_stride, const scalar_t* weight,
                   int64_t rows, int64_t dim, float eps) {
  // A row's dependent steps (its sum's reduction, the square root, the division) cost
  // about as much as a few hundred elements' arithmetic: a decode step's 256 rows of 64
  // are work for two threads, not one.
  constexpr int64_t kRowSteps = 512;
  parallel_for(0, rows, grain_for(dim + kRowSteps), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* in = x + r * x_stride;
      if (residual != nullptr) {
        // transformers adds in the model dtype, then normalises the rounded sum.
        scalar_t* res = residual + r * residual_stride;
        for (int64_t i = 0; i < dim; ++i) {
          res[i] = round_to<scalar_t>(static_cast<float>(res[i]) + static_cast<float>(in[i]));
        }
        in = res;
      }
      // fp32 rows: a vector of partial sums (a scalar sum is one chain of dependent adds,
      // which the compiler may not reorder).
      float sum_sq = 0.f;
      if constexpr (std::is_same_v<scalar_t, float>) {
        sum_sq = dot(in, in, dim);
      } else {
        for (int64_t i = 0; i < dim; ++i) {
          const float v = static_cast<float>(in[i]);
          sum_sq += v * v;
        }
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
      scalar_t* o = out + r * out_stride;
      for (int64_t i = 0; i < dim; ++i) {
        const float normed =
            static_cast<float>(round_to<scalar_t>(static_cast<float>(in[i]) * inv_rms));
        o[i] = round_to<scalar_t>(static_cast<float>(weight[i]) * normed);
      }
    }
  });
}

// ---------------------------------------------------------------------------------
// Rotary embedding, rotate-half layout: element i pairs with element i + D/2. `angles` is
// a position's row of the cos_sin table: D/2 cosines, then D/2 sines.

// Float heads of D = 2^k <= kVectorWidth floats, kVectorWidth / D heads to a vector: each
// lane's partner (i <-> i + D/2) is one fixed shuffle away, and the angles are laid across
// the lanes once a call. Heads this narrow (stories260K's 8) left the scalar loop below
// too short to vectorise: it was 4 % of a decode step. Returns how many heads it rotated
// (whole vectors of them); the caller rotates the rest.
template <int D, int... I>
inline int64_t rotate_narrow_heads(float* out, const float* in, int64_t num_heads,
                                   const float* angles, std::integer_sequence<int, I...>) {
  if constexpr (D > kVectorWidth) {
    return 0;
  } else {
    constexpr int half = D / 2;
    // A vector of D lanes, widened by the shuffles: copied into a whole vector through
    // memory instead, the wide load could not take its data from the narrow stores and
    // waited for them (a third of the function's time).
    typedef float AngleVec __attribute__((vector_size(D * sizeof(float))));
    AngleVec a;
    __builtin_memcpy(&a, angles, sizeof(a));
    const FloatVec cos = __builtin_shufflevector(a, a, (I % half)...);
    // x1 cos - x2 sin for the first half of a head, x2 cos + x1 sin for the second.
    const FloatVec sin = __builtin_shufflevector(a, a, (half + I % half)...) *
                         FloatVec{(I % D < half ? -1.f : 1.f)...};
    const int64_t vectors = num_heads * D / kVectorWidth;
    for (int64_t v = 0; v < vectors; ++v) {
      const FloatVec value = load_vec(in + v * kVectorWidth);
      const FloatVec partner = __builtin_shufflevector(value, value, (I ^ half)...);
      const FloatVec rotated = value * cos + partner * sin;
      __builtin_memcpy(out + v * kVectorWidth, &rotated, sizeof(rotated));
    }
    return vectors * (kVectorWidth / D);
  }
}

// out = the heads of `in` rotated (out may be in).
template <typename scalar_t>
void rotate_heads(scalar_t* out, const scalar_t* in, int64_t num_heads, int64_t head_dim,
                  const float* angles) {
  const int64_t half = head_dim / 2;
  int64_t h = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (head_dim == 4) {
      h = rotate_narrow_heads<4>(out, in, num_heads, angles, VectorLanes{});
    } else if (head_dim == 8) {
      h = rotate_narrow_heads<8>(out, in, num_heads, angles, VectorLanes{});
    } else if (head_dim == 16) {
      h = rotate_narrow_heads<16>(out, in, num_heads, angles, VectorLanes{});
    }
  }
  if (h == num_heads) return;
  // The rest in place: a loop reading `in` and writing `out`, which may be the same row,
  // vectorised only behind a run-time overlap test (heads of 48 took 1.4x as long).
  if (out != in) std::copy(in + h * head_dim, in + num_heads * head_dim, out + h * head_dim);
  const float* cos = angles;
  const float* sin = angles + half;
  for (; h < num_heads; ++h) {
    scalar_t* x = out + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(x[i]);
      const float x2 = static_cast<float>(x[i + half]);
      x[i] = round_to<scalar_t>(x1 * cos[i] - x2 * sin[i]);
      x[i + half] = round_to<scalar_t>(x2 * cos[i] + x1 * sin[i]);
    }
  }
}

template <typename scalar_t>
void rotary_rows(const int32_t* positions, scalar_t* q, int64_t q_stride, int64_t num_heads,
                 scalar_t* k, int64_t k_stride, int64_t num_kv_heads, const float* cos_sin,
                 int64_t num_tokens, int64_t head_dim) {
  const int64_t work = (num_heads + num_kv_heads) * head_dim;
  parallel_for(0, num_tokens, grain_for(work), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* angles = cos_sin + static_cast<int64_t>(positions[t]) * head_dim;
      rotate_heads(q + t * q_stride, q + t * q_stride, num_heads, head_dim, angles);
      rotate_heads(k + t * k_stride, k + t * k_stride, num_kv_heads, head_dim, angles);
    }
  });
}

// ---------------------------------------------------------------------------------
// SiLU(gate) * up

template <typename scalar_t>
void silu_and_mul_rows(scalar_t* out, int64_t out_stride, const scalar_t* gate_up,
                       int64_t in_stride, int64_t rows, int64_t width) {
  parallel_for(0, rows, grain_for(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = gate_up + r * in_stride;
      const scalar_t* up = gate + width;
      scalar_t* o = out + r * out_stride;
      for (int64_t i = 0; i < width; ++i) {
        const float act = static_cast<float>(round_to<scalar_t>(silu(static_cast<float>(gate[i]))));
        o[i] = round_to<scalar_t>(act * static_cast<float>(up[i]));
      }
    }
  });
}

// ---------------------------------------------------------------------------------
// Paged KV cache write

template <typename scalar_t>
void write_kv_rows(const scalar_t* key, int64_t key_stride, const scalar_t* value,
                   int64_t value_stride, scalar_t* k_cache, scalar_t* v_cache,
                   const int32_t* slots, int64_t num_tokens, int64_t row_elems) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    std::memcpy(k_cache + slot * row_elems, key + t * key_stride, row_elems * sizeof(scalar_t));
    std::memcpy(v_cache + slot * row_elems, value + t * value_stride, row_elems * sizeof(scalar_t));
  }
}

// kv_cache_dtype=int8: one head's row of D values as int8 with one float32 scale, exactly
// as llmctl.engine.quant.quantize_kv computes it (so turbo and the torch backend hold the
// same cache bytes): scale = max|x| / 127 (1 for an all-zero row), q = x / scale rounded
// to nearest, ties to even (std::nearbyint in the default rounding mode, as torch.round),
// clamped to [-127, 127]. A division, not a multiply by 1 / scale: that would round
// differently.
template <typename scalar_t>
inline void quantize_row_int8(const scalar_t* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  *scale = s;
  for (int64_t d = 0; d < D; ++d) {
    const float rounded = std::nearbyint(static_cast<float>(x[d]) / s);
    q[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, rounded)));
  }
}

// write_kv_rows for an int8 cache: each (token, kv head) row quantized with its scale
// stored at the same [slot, kv head] place of k_scale / v_scale.
template <typename scalar_t>
void write_kv_rows_int8(const scalar_t* key, int64_t key_stride, const scalar_t* value,
                        int64_t value_stride, int8_t* k_cache, int8_t* v_cache, float* k_scale,
                        float* v_scale, const int32_t* slots, int64_t num_tokens,
                        int64_t num_kv_heads, int64_t D) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t row = slot * num_kv_heads + h;
      quantize_row_int8(key + t * key_stride + h * D, D, k_cache + row * D, k_scale + row);
      quantize_row_int8(value + t * value_stride + h * D, D, v_cache + row * D, v_scale + row);
    }
  }
}

// ---------------------------------------------------------------------------------
// Paged attention. One work item is (a run of query rows of one sequence, kv head): the
// `group` query heads of each row that share the kv head read each key and value row
// once for all the run's rows, straight from the sequence's blocks, so the cost follows
// each sequence's own context length, and the rows a step verifies (or a prefill chunk's)
// share those reads while the block is in L1. One item per row, which read every block
// again for each row, took 1.2-1.3x as long for a 1,024-token prefill or 16 rows at 600
// tokens of context (scripts/bench_attention.py, docs/benchmarks.md). Scores are kept
// for the whole context (two-pass softmax), which the context lengths served on a CPU
// afford.

// Rows of a cache block as fp32 (rows `stride` apart): the block itself for fp32 storage,
// else converted into `buffer` (rows D apart). An int8 block's rows come out unscaled:
// attention folds each row's scale into its score or its softmax weight.
template <typename scalar_t>
const float* rows_as_float(const scalar_t* rows, int64_t stride, int64_t count, int64_t D,
                           float* buffer, int64_t& float_stride) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    float_stride = stride;
    return rows;
  } else {
    for (int64_t j = 0; j < count; ++j) {
      for (int64_t d = 0; d < D; ++d) buffer[j * D + d] = static_cast<float>(rows[j * stride + d]);
    }
    float_stride = D;
    return buffer;
  }
}

// Attention reads rows of head_dim floats: in vectors of the target's width where
// head_dim is a multiple of it, else of 8 or 4 floats (8 in stories260K), else plain
// floats.
typedef float Float8Vec __attribute__((vector_size(8 * sizeof(float))));
typedef float Float4Vec __attribute__((vector_size(4 * sizeof(float))));

template <typename Vec>
inline Vec load_as(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// scores[j] = q . keys[j] for `count` keys `stride` apart, four keys at a time so that one
// horizontal sum serves four scores. D is a multiple of Vec's lanes.
template <typename Vec>
inline void score_keys_with(const float* q, const float* keys, int64_t stride, int64_t count,
                            int64_t D, float* scores) {
  constexpr int64_t kLanes = sizeof(Vec) / sizeof(float);
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const float* k = keys + j * stride;
    Vec a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t d = 0; d < D; d += kLanes) {
      const Vec qv = load_as<Vec>(q + d);
      a0 += qv * load_as<Vec>(k + d);
      a1 += qv * load_as<Vec>(k + stride + d);
      a2 += qv * load_as<Vec>(k + 2 * stride + d);
      a3 += qv * load_as<Vec>(k + 3 * stride + d);
    }
    float sums[4];
    reduce_add4(a0, a1, a2, a3, sums);
    for (int i = 0; i < 4; ++i) scores[j + i] = sums[i];
  }
  for (; j < count; ++j) {
    Vec acc = {};
    for (int64_t d = 0; d < D; d += kLanes) acc += load_as<Vec>(q + d) * load_as<Vec>(keys + j * stride + d);
    scores[j] = reduce_add(acc);
  }
}

inline void score_keys(const float* q, const float* keys, int64_t stride, int64_t count,
                       int64_t D, float* scores) {
  if (D % kVectorWidth == 0) {
    score_keys_with<FloatVec>(q, keys, stride, count, D, scores);
  } else if (D % 8 == 0) {
    score_keys_with<Float8Vec>(q, keys, stride, count, D, scores);
  } else if (D % 4 == 0) {
    score_keys_with<Float4Vec>(q, keys, stride, count, D, scores);
  } else {
    for (int64_t j = 0; j < count; ++j) scores[j] = dot(q, keys + j * stride, D);
  }
}

// acc[0 .. NV vectors) += sum over j of weights[j] * values[j]. The sums stay in registers
// over all `count` rows, U rows at a time into U sets of sums: with one set, each row's
// multiply-adds wait for the previous row's (the FMA latency), and a small head (one or
// two vectors) ran at a fraction of the FMA throughput.
template <typename Vec, int NV, int U>
inline void accumulate_values_tile(float* acc, const float* weights, const float* values,
                                   int64_t stride, int64_t count) {
  constexpr int64_t kLanes = sizeof(Vec) / sizeof(float);
  Vec sums[U][NV] = {};
  int64_t j = 0;
  for (; j + U <= count; j += U) {
    for (int u = 0; u < U; ++u) {
      const float* row = values + (j + u) * stride;
      for (int n = 0; n < NV; ++n) sums[u][n] += load_as<Vec>(row + n * kLanes) * weights[j + u];
    }
  }
  for (; j < count; ++j) {
    for (int n = 0; n < NV; ++n) {
      sums[0][n] += load_as<Vec>(values + j * stride + n * kLanes) * weights[j];
    }
  }
  for (int n = 0; n < NV; ++n) {
    Vec total = load_as<Vec>(acc + n * kLanes);
    for (int u = 0; u < U; ++u) total += sums[u][n];
    __builtin_memcpy(acc + n * kLanes, &total, sizeof(total));
  }
}

// The same for any D that is a multiple of Vec's lanes: up to 8 vectors at a time, with
// about 8 sums in flight whatever the head's width.
template <typename Vec>
inline void accumulate_values_with(float* acc, const float* weights, const float* values,
                                   int64_t stride, int64_t count, int64_t D) {
  constexpr int64_t kLanes = sizeof(Vec) / sizeof(float);
  for (int64_t d = 0; d < D; d += 8 * kLanes) {
    float* a = acc + d;
    const float* v = values + d;
    switch (std::min<int64_t>(8, (D - d) / kLanes)) {
      case 1: accumulate_values_tile<Vec, 1, 8>(a, weights, v, stride, count); break;
      case 2: accumulate_values_tile<Vec, 2, 4>(a, weights, v, stride, count); break;
      case 3: accumulate_values_tile<Vec, 3, 2>(a, weights, v, stride, count); break;
      case 4: accumulate_values_tile<Vec, 4, 2>(a, weights, v, stride, count); break;
      case 5: accumulate_values_tile<Vec, 5, 1>(a, weights, v, stride, count); break;
      case 6: accumulate_values_tile<Vec, 6, 1>(a, weights, v, stride, count); break;
      case 7: accumulate_values_tile<Vec, 7, 1>(a, weights, v, stride, count); break;
      default: accumulate_values_tile<Vec, 8, 1>(a, weights, v, stride, count); break;
    }
  }
}

inline void accumulate_values(float* acc, const float* weights, const float* values,
                              int64_t stride, int64_t count, int64_t D) {
  if (D % kVectorWidth == 0) {
    accumulate_values_with<FloatVec>(acc, weights, values, stride, count, D);
  } else if (D % 8 == 0) {
    accumulate_values_with<Float8Vec>(acc, weights, values, stride, count, D);
  } else if (D % 4 == 0) {
    accumulate_values_with<Float4Vec>(acc, weights, values, stride, count, D);
  } else {
    for (int64_t j = 0; j < count; ++j) {
      for (int64_t d = 0; d < D; ++d) acc[d] += weights[j] * values[j * stride + d];
    }
  }
}

// The query rows of one work item: `count` consecutive rows of sequence `seq` from
// `first` (an index into the step's tokens).
struct QueryRun {
  int64_t seq, first, count;
};

// Each sequence's query rows cut into runs: at most kMaxRunRows rows, and fewer where a
// run's scores (rows x group x context floats) would outgrow L2 or where the batch has
// too few (run, kv head) items to keep every thread busy (one sequence verifying
// proposals: 5 rows x 3 kv heads on 2 threads run as 2 runs).
constexpr int64_t kMaxRunRows = 8;
constexpr int64_t kRunScoreFloats = 64 * 1024;

inline std::vector<QueryRun> query_runs(const int32_t* query_start_loc, int64_t num_seqs,
                                        int64_t num_kv_heads, int64_t group,
                                        int64_t max_context) {
  const int64_t fit = std::clamp<int64_t>(kRunScoreFloats / (group * max_context), 1,
                                          kMaxRunRows);
  const int64_t wanted = 2 * num_threads();  // items, for the pool to balance
  const int64_t items = std::max<int64_t>(1, num_seqs * num_kv_heads);  // with one run each
  const int64_t per_seq = (wanted + items - 1) / items;
  std::vector<QueryRun> runs;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t first = query_start_loc[b], q_len = query_start_loc[b + 1] - first;
    if (q_len == 0) continue;
    const int64_t pieces = std::max((q_len + fit - 1) / fit, std::min(q_len, per_seq));
    const int64_t rows = (q_len + pieces - 1) / pieces;
    for (int64_t t = 0; t < q_len; t += rows) {
      runs.push_back({b, first + t, std::min(rows, q_len - t)});
    }
  }
  return runs;
}

// Attention for heads narrower than a vector (head_dim 4 or 8 on AVX-512, 4 on AVX2;
// stories260K's heads are 8 floats). The per-head path below spends a horizontal sum on
// every four keys and a work item on every (run of query rows, kv head): at stories260K's
// heads, 256 decoding sequences, a work item cost about 170 ns before its first key and
// 7.5 ns a key. Here one work item is a query row with all its heads, and a vector holds
// P = L / D kv heads side by side, as a cache row stores them: a token's keys are
// R = KVH / P vectors, each met by the `group` query vectors laid out to match (query
// vector qv = r * group + g holds, in segment p, head (r P + p) group + g). A token gives
// NQ = R group vectors of products; those of TB = D / NQ tokens (D vectors) fold into one
// vector of scores (segment_sums), token-major with the H heads in "position" order
// qv * P + p. A value row's vector takes its weights by one shuffle of those scores.

// Lane i of fold_halves<W>(a, b)'s first (upper = false) or second shuffle: segment s of
// W lanes in a (low half of the result) or b (high half) gives its lower or upper half.
constexpr int fold_source(int width, int i, bool upper) {
  const int half = kVectorWidth / 2, from_b = i >= half ? 1 : 0, j = i - from_b * half;
  return from_b * kVectorWidth + j / (width / 2) * width + j % (width / 2) +
         (upper ? width / 2 : 0);
}

// Each W-lane segment of a and of b summed with its other half: W/2-lane segments, a's
// in the low half of the result and b's in the high half, each in order.
template <int W, int... I>
__attribute__((always_inline)) inline FloatVec fold_halves(FloatVec a, FloatVec b,
                                                           std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, fold_source(W, I, false)...) +
         __builtin_shufflevector(a, b, fold_source(W, I, true)...);
}

// The sums of W vectors' W-lane segments as one vector: vector m's segment p lands in lane
// m * (L / W) + p. A tree of log2(W) levels, each halving the vectors and the segments.
// Always inlined, like fold_halves: called, the vectors went through memory and the
// kernel took about 1.6x as long.
template <int W>
__attribute__((always_inline)) inline FloatVec segment_sums(FloatVec* v) {
  if constexpr (W == 1) {
    return v[0];
  } else {
    for (int m = 0; m < W / 2; ++m) v[m] = fold_halves<W>(v[2 * m], v[2 * m + 1], VectorLanes{});
    return segment_sums<W / 2>(v);
  }
}

// products[TT * NQ + QV] = query vector QV times its vector of token TT's key row
// rows[TT]: unrolled, so that the products stay in registers (a loop over the tokens
// kept them in memory, between the multiplies and segment_sums).
template <int NQ, typename cache_t, int TT, int... QV>
__attribute__((always_inline)) inline void key_products(FloatVec* products, const FloatVec* qs,
                                                        const cache_t* row,
                                                        const int64_t* offsets,
                                                        std::integer_sequence<int, QV...>) {
  ((products[TT * NQ + QV] = qs[QV] * load_vec(row + offsets[QV])), ...);
}

// key_products for each token slot TT of rows.
template <int NQ, typename cache_t, int... TT>
__attribute__((always_inline)) inline void token_products(FloatVec* products, const FloatVec* qs,
                                                          const cache_t* const* rows,
                                                          const int64_t* offsets,
                                                          std::integer_sequence<int, TT...>) {
  (key_products<NQ, cache_t, TT>(products, qs, rows[TT], offsets,
                                 std::make_integer_sequence<int, NQ>{}),
   ...);
}

// Segment p of query vector QV takes position QV * P + p of token slot TT: each of its D
// lanes that lane of `scores`.
template <int H, int P, int D, int TT, int QV, int... I>
inline FloatVec position_weights(FloatVec scores, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(scores, scores, (TT * H + QV * P + I / D)...);
}

// acc[QV] += the weights of token slot TT times the value row's vector of QV.
template <int H, int P, int D, int TT, typename cache_t, int... QV>
inline void add_weighted_values(FloatVec* acc, FloatVec scores, const cache_t* row,
                                const int64_t* offsets, std::integer_sequence<int, QV...>) {
  ((acc[QV] += position_weights<H, P, D, TT, QV>(scores, VectorLanes{}) *
               load_vec(row + offsets[QV])),
   ...);
}

// add_weighted_values for each token of one vector of scores (rows[TT]: token TT's values).
template <int H, int P, int D, typename cache_t, int... TT>
inline void add_weighted_tokens(FloatVec* acc, FloatVec scores, const cache_t* const* rows,
                                const int64_t* offsets, std::integer_sequence<int, TT...>) {
  constexpr int NQ = H / P;
  (add_weighted_values<H, P, D, TT>(acc, scores, rows[TT], offsets,
                                    std::make_integer_sequence<int, NQ>{}),
   ...);
}

// acc[QV] *= each segment's position's factor (lanes of `factors`, H-periodic).
template <int H, int P, int D, int... QV>
inline void scale_positions(FloatVec* acc, FloatVec factors, std::integer_sequence<int, QV...>) {
  ((acc[QV] *= position_weights<H, P, D, 0, QV>(factors, VectorLanes{})), ...);
}

// A decode step's new tokens (token b is sequence b's), not yet rotated or in the cache:
// the attention pass rotates q and k (rotate_heads, as rotary_rows does), writes k and v
// to slots[b] (as write_kv_rows does), then attends, one sequence at a time. Rotary
// and cache write then cost no pass of their own over the step's rows. (A prompt's rows
// attend to each other's keys, so they are written before any attends: not here.)
template <typename scalar_t>
struct NewTokens {
  const int32_t* positions;
  const float* cos_sin;  // [max positions, D]: cos in the first half, sin in the second
  const int32_t* slots;
  const scalar_t* k;
  int64_t k_stride;
  const scalar_t* v;
  int64_t v_stride;
  scalar_t* k_cache;  // the caches the pass reads, written here
  scalar_t* v_cache;
};

// Every query row of the step (query row t of sequence b sees keys 0 .. context_lens[b] -
// q_len + i, i its index among b's rows) over a float or bf16 cache, for D < L and
// NQ = H D / L query vectors (NQ <= D). `fresh`: a decode step's new tokens, else null
// (in the cache and rotated already).
template <int D, int NQ, typename scalar_t>
void narrow_attention_rows(scalar_t* out, const scalar_t* q, const scalar_t* k_cache,
                           const scalar_t* v_cache, const int32_t* block_tables,
                           const int32_t* query_start_loc, const int32_t* context_lens,
                           const AttentionShape& s, float scale,
                           const NewTokens<scalar_t>* fresh) {
  constexpr int L = kVectorWidth, P = L / D, H = NQ * P, TB = D / NQ;
  static_assert(D < L && NQ <= D && TB * NQ == D);
  const int64_t group = H / s.num_kv_heads;
  const int64_t row_elems = s.num_kv_heads * D, block_elems = s.block_size * row_elems;
  // Query vector qv's head in segment p, and the offset of its cache vector in a row.
  int64_t head_of[NQ][P], offsets[NQ];
  for (int qv = 0; qv < NQ; ++qv) {
    offsets[qv] = qv / group * L;
    for (int p = 0; p < P; ++p) head_of[qv][p] = (qv / group * P + p) * group + qv % group;
  }
  int64_t max_context = 1, total_keys = 0;
  for (int64_t b = 0; b < s.num_seqs; ++b) {
    const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
    max_context = std::max<int64_t>(max_context, context_lens[b]);
    total_keys += q_len * context_lens[b];
  }
  const int64_t work_per_row = (total_keys / std::max<int64_t>(1, s.num_tokens) + 1) * H * D * 2;
  parallel_for(0, s.num_tokens, grain_for(work_per_row), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    thread_local std::vector<int64_t> row_scratch, next_scratch;
    float* scores = aligned_floats(scratch, round_up(max_context, TB) * H);
    row_scratch.resize(round_up(max_context, TB));
    next_scratch.resize(round_up(max_context, TB));
    int64_t* row_offsets = row_scratch.data();
    int64_t* next_offsets = next_scratch.data();
    // offsets[j] = the cache row of sequence b's key j, for j in [from, n) (a division per
    // block, not per key).
    const auto fill_offsets = [&](int64_t* offsets, int64_t b, int64_t from, int64_t n) {
      const int32_t* table = block_tables + b * s.table_stride;
      for (int64_t j = from; j < n;) {
        const int64_t in_block = j % s.block_size;
        const int64_t first = table[j / s.block_size] * block_elems;
        const int64_t count = std::min(s.block_size - in_block, n - j);
        for (int64_t i = 0; i < count; ++i) offsets[j + i] = first + (in_block + i) * row_elems;
        j += count;
      }
    };
    // The sequence of row `begin`; how many of its keys' offsets are in row_offsets; and
    // the sequence whose first next_filled offsets are in next_offsets (-1: none).
    int64_t b = std::upper_bound(query_start_loc, query_start_loc + s.num_seqs + 1, begin) -
                query_start_loc - 1;
    int64_t offsets_of = -1, offsets_filled = 0, next_of = -1, next_filled = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= query_start_loc[b + 1]) ++b;
      const int64_t n = keys_seen(query_start_loc, context_lens, b, t);
      scalar_t* o = out + t * s.out_stride;
      if (n <= 0) {  // a padding row: nothing to attend to
        std::fill(o, o + H * D, round_to<scalar_t>(0.f));
        continue;
      }
      // Each key's row in the cache, kept for the sequence's next row (or found while the
      // row before read its values); past the row's keys, up to a whole vector of scores,
      // its last key's (whose weight is zeroed below).
      if (offsets_of != b) {
        offsets_filled = 0;
        if (next_of == b) std::swap(row_offsets, next_offsets), offsets_filled = next_filled;
        offsets_of = b, next_of = -1;
      }
      fill_offsets(row_offsets, b, offsets_filled, n);
      offsets_filled = n;  // the padding below is past it
      // The keys of the next row's sequence, when it is another one (a decode step's rows
      // are each a sequence): asked for while this row reads its values (prefetch_rows).
      int64_t next_n = 0;
      if (t + 1 < end && t + 1 >= query_start_loc[b + 1]) {
        int64_t next_b = b + 1;
        while (t + 1 >= query_start_loc[next_b + 1]) ++next_b;
        next_n = keys_seen(query_start_loc, context_lens, next_b, t + 1);
        if (next_n > 0) {
          fill_offsets(next_offsets, next_b, 0, next_n);
          next_of = next_b, next_filled = next_n;
        }
      }
      const int64_t padded = round_up(n, TB);
      std::fill(row_offsets + n, row_offsets + padded, row_offsets[n - 1]);
      const scalar_t* q_row = q + t * s.q_stride;
      scalar_t rotated[H * D];
      if (fresh) {
        const float* angles = fresh->cos_sin + static_cast<int64_t>(fresh->positions[t]) * D;
        rotate_heads(rotated, q_row, H, D, angles);
        q_row = rotated;
        if (fresh->slots[t] >= 0) {
          scalar_t* k_slot = fresh->k_cache + fresh->slots[t] * row_elems;
          rotate_heads(k_slot, fresh->k + t * fresh->k_stride, s.num_kv_heads, D, angles);
          std::copy(fresh->v + t * fresh->v_stride, fresh->v + t * fresh->v_stride + row_elems,
                    fresh->v_cache + fresh->slots[t] * row_elems);
        }
      }
      FloatVec qs[NQ];
      for (int qv = 0; qv < NQ; ++qv) {
        alignas(64) float lanes[L];
        for (int l = 0; l < L; ++l) {
          lanes[l] = static_cast<float>(q_row[head_of[qv][l / D] * D + l % D]) * scale;
        }
        qs[qv] = load_vec(lanes);
      }

      // Scores, TB tokens to a vector.
      FloatVec best = FloatVec{} - 3.0e38f;
      for (int64_t t0 = 0; t0 < padded; t0 += TB) {
        const scalar_t* rows[TB];
        for (int tt = 0; tt < TB; ++tt) {
          prefetch_rows(v_cache + row_offsets[t0 + tt], 1, 0, row_elems);  // read next pass
          rows[tt] = k_cache + row_offsets[t0 + tt];
        }
        FloatVec products[D];
        token_products<NQ>(products, qs, rows, offsets, std::make_integer_sequence<int, TB>{});
        const FloatVec sums = segment_sums<D>(products);
        __builtin_memcpy(scores + t0 * H, &sums, sizeof(sums));
        best = best > sums ? best : sums;  // padding repeats the last token
      }
      best = fold_lanes<H>(best, [](FloatVec a, FloatVec c) { return a > c ? a : c; });

      // Softmax numerators; the padding's are zero.
      alignas(64) float best_lanes[L];
      __builtin_memcpy(best_lanes, &best, sizeof(best));
      for (int64_t i = 0; i < padded * H; i += L) {
        for (int l = 0; l < L; ++l) scores[i + l] = exp_nonpositive(scores[i + l] - best_lanes[l]);
      }
      std::fill(scores + n * H, scores + padded * H, 0.f);
      FloatVec total = {};
      for (int64_t i = 0; i < padded * H; i += L) total += load_vec(scores + i);
      total = fold_lanes<H>(total, [](FloatVec a, FloatVec c) { return a + c; });

      // Weighted sum of values.
      FloatVec acc[NQ] = {};
      for (int64_t t0 = 0; t0 < padded; t0 += TB) {
        const scalar_t* rows[TB];
        for (int tt = 0; tt < TB; ++tt) rows[tt] = v_cache + row_offsets[t0 + tt];
        for (int64_t j = t0; j < std::min(t0 + TB, next_n); ++j) {
          prefetch_rows(k_cache + next_offsets[j], 1, 0, row_elems);  // the next row's keys
        }
        add_weighted_tokens<H, P, D>(acc, load_vec(scores + t0 * H), rows, offsets,
                                     std::make_integer_sequence<int, TB>{});
      }
      const FloatVec inverse = 1.f / total;
      scale_positions<H, P, D>(acc, inverse, std::make_integer_sequence<int, NQ>{});
      for (int qv = 0; qv < NQ; ++qv) {
        alignas(64) float lanes[L];
        __builtin_memcpy(lanes, &acc[qv], sizeof(lanes));
        for (int p = 0; p < P; ++p) {
          scalar_t* head = o + head_of[qv][p] * D;
          for (int d = 0; d < D; ++d) head[d] = round_to<scalar_t>(lanes[p * D + d]);
        }
      }
    }
  });
}

// Runs narrow_attention_rows where the cache is float or bf16 of the query's type and the
// heads fit it (and, with new tokens to write, the step is all decodes); false (nothing
// done) otherwise.
template <typename scalar_t, typename cache_t>
bool narrow_attention(scalar_t* out, const scalar_t* q, const cache_t* k_cache,
                      const cache_t* v_cache, const int32_t* block_tables,
                      const int32_t* query_start_loc, const int32_t* context_lens,
                      const AttentionShape& s, float scale,
                      const NewTokens<scalar_t>* fresh = nullptr) {
  if constexpr (!std::is_same_v<scalar_t, cache_t> || std::is_same_v<scalar_t, c10::Half>) {
    return false;
  } else {
    const int64_t D = s.head_dim, L = kVectorWidth;
    if (D >= L || s.num_kv_heads * D % L != 0) return false;
    if (fresh) {
      if (s.num_tokens != s.num_seqs) return false;
      for (int64_t b = 0; b < s.num_seqs; ++b) {
        if (query_start_loc[b] != b) return false;
      }
    }
    const int64_t query_vectors = s.num_heads * D / L;
    auto run = [&](auto kernel) {
      kernel(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, s, scale,
             fresh);
      return true;
    };
    if constexpr (kVectorWidth > 8) {
      if (D == 8) {
        switch (query_vectors) {
          case 1: return run(narrow_attention_rows<8, 1, scalar_t>);
          case 2: return run(narrow_attention_rows<8, 2, scalar_t>);
          case 4: return run(narrow_attention_rows<8, 4, scalar_t>);
          case 8: return run(narrow_attention_rows<8, 8, scalar_t>);
        }
      }
    }
    if constexpr (kVectorWidth > 4) {
      if (D == 4) {
        switch (query_vectors) {
          case 1: return run(narrow_attention_rows<4, 1, scalar_t>);
          case 2: return run(narrow_attention_rows<4, 2, scalar_t>);
          case 4: return run(narrow_attention_rows<4, 4, scalar_t>);
        }
      }
    }
    return false;
  }
}

// The cache is the queries' type, or int8 (kv_cache_dtype=int8) with k_scale / v_scale
// its float32 scales [num_blocks, block_size, KVH] (else null). Dequantizing is one
// multiply per key row: q . (k * ks) = (q . k) * ks on each score, and v * vs folded into
// the row's softmax weight (after the softmax sum, which needs the unscaled weights).
template <typename scalar_t, typename cache_t>
void paged_attention_rows(scalar_t* out, const scalar_t* q, const cache_t* k_cache,
                          const cache_t* v_cache, const float* k_scale, const float* v_scale,
                          const int32_t* block_tables, const int32_t* query_start_loc,
                          const int32_t* context_lens, const AttentionShape& s, float scale) {
  if (narrow_attention(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                       s, scale)) {
    return;
  }
  const int64_t D = s.head_dim;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t row_elems = s.num_kv_heads * D;  // one token of one block
  const int64_t block_elems = s.block_size * row_elems;

  int64_t total_keys = 0, max_context = 1;
  for (int64_t b = 0; b < s.num_seqs; ++b) {
    const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
    total_keys += q_len * context_lens[b];
    max_context = std::max<int64_t>(max_context, context_lens[b]);
  }
  const std::vector<QueryRun> runs =
      query_runs(query_start_loc, s.num_seqs, s.num_kv_heads, group, max_context);
  int64_t max_rows = 1;
  for (const QueryRun& run : runs) max_rows = std::max(max_rows, run.count);
  const int64_t max_vectors = max_rows * group;  // query vectors of one item, at most

  // Work per item on average, so that a batch of short contexts stays on one thread.
  const int64_t num_items = static_cast<int64_t>(runs.size()) * s.num_kv_heads;
  const int64_t keys_per_item = total_keys * s.num_kv_heads / std::max<int64_t>(1, num_items);
  const int64_t work_per_item = std::max<int64_t>(1, keys_per_item) * group * D * 2;
  parallel_for(0, num_items, grain_for(work_per_item), [&](int64_t begin, int64_t end) {
    // Each part starts on a cache line, and so does each query vector's row of it (for
    // heads of 16 floats or more): a vector load that straddles two lines costs two, and
    // the scores' dot products, which load their query vector once per four keys, ran
    // 1.3x slower from the 16-byte-aligned memory of a plain vector.
    thread_local std::vector<float> scratch;
    const int64_t score_stride = round_up(max_context, kLineFloats);
    float* scores = aligned_floats(scratch, max_vectors * (score_stride + 2 * D) +
                                                round_up(max_vectors, kLineFloats) +
                                                s.block_size * D);
    float* q_scaled = scores + max_vectors * score_stride;  // one row per query vector
    float* acc = q_scaled + max_vectors * D;
    float* sums = acc + max_vectors * D;
    float* block_buffer = sums + round_up(max_vectors, kLineFloats);
    for (int64_t item = begin; item < end; ++item) {
      const QueryRun run = runs[item / s.num_kv_heads];
      const int64_t kv_head = item % s.num_kv_heads;
      const int64_t b = run.seq;
      // Query vector v = i * group + h (row run.first + i, head kv_head * group + h)
      // sees the keys before its own position and itself, causally.
      const int64_t first_keys = keys_seen(query_start_loc, context_lens, b, run.first);
      const int64_t num_keys = first_keys + run.count - 1;  // the run's last row's
      const int64_t vectors = run.count * group;
      auto keys_of = [&](int64_t v) { return first_keys + v / group; };
      const int32_t* table = block_tables + b * s.table_stride;
      const int64_t first_head = kv_head * group;

      for (int64_t v = 0; v < vectors; ++v) {
        const int64_t t = run.first + v / group, head = first_head + v % group;
        const scalar_t* qv = q + t * s.q_stride + head * D;
        for (int64_t d = 0; d < D; ++d) q_scaled[v * D + d] = static_cast<float>(qv[d]) * scale;
      }

      // fn(start, count, rows, stride, row_scales) for each block of this item's keys or
      // values, the block's rows as fp32 (no division per key) and, for an int8 cache, their
      // scales (num_kv_heads apart; else null). Every query vector of the item uses a block
      // while it is in L1.
      auto for_each_block = [&](const cache_t* cache, const float* cache_scales,
                                const auto& fn) {
        for (int64_t start = 0; start < num_keys; start += s.block_size) {
          const int64_t count = std::min(s.block_size, num_keys - start);
          const int64_t block = table[start / s.block_size];
          int64_t stride;
          const float* rows = rows_as_float(cache + block * block_elems + kv_head * D,
                                            row_elems, count, D, block_buffer, stride);
          const float* row_scales =
              cache_scales ? cache_scales + block * s.block_size * s.num_kv_heads + kv_head
                           : nullptr;
          fn(start, count, rows, stride, row_scales);
        }
      };

      // The kv head's part of the block holding key `start` (of `keys`) asked for
      // (prefetch_rows): while pass 1 reads a block of keys, that block's values and the
      // next block's keys; while pass 2 reads its last block of values, the next item's
      // first keys. Each block's own loads then mostly find it in L2.
      const auto prefetch_head = [&](const cache_t* cache, const int32_t* blocks, int64_t head,
                                     int64_t start, int64_t keys) {
        const int64_t count = std::min(s.block_size, keys - start);
        if (count > 0) {
          prefetch_rows(cache + blocks[start / s.block_size] * block_elems + head * D, count,
                        row_elems, D);
        }
      };

      // Pass 1: scores.
      for_each_block(k_cache, k_scale, [&](int64_t start, int64_t count, const float* keys,
                                           int64_t stride, const float* key_scales) {
        prefetch_head(v_cache, table, kv_head, start, num_keys);
        prefetch_head(k_cache, table, kv_head, start + s.block_size, num_keys);
        for (int64_t v = 0; v < vectors; ++v) {
          const int64_t seen = std::min(count, keys_of(v) - start);
          if (seen <= 0) continue;
          float* sv = scores + v * score_stride + start;
          score_keys(q_scaled + v * D, keys, stride, seen, D, sv);
          if (key_scales) {
            for (int64_t j = 0; j < seen; ++j) sv[j] *= key_scales[j * s.num_kv_heads];
          }
        }
      });

      // Softmax numerators (normalised at the end).
      for (int64_t v = 0; v < vectors; ++v) {
        float* sv = scores + v * score_stride;
        const int64_t n = keys_of(v);
        const float max_score = max_of(sv, n);
        for (int64_t j = 0; j < n; ++j) sv[j] = exp_nonpositive(sv[j] - max_score);
        sums[v] = sum_of(sv, n);
      }

      // Pass 2: weighted sum of values.
      std::fill(acc, acc + vectors * D, 0.f);
      for_each_block(v_cache, v_scale, [&](int64_t start, int64_t count, const float* values,
                                           int64_t stride, const float* value_scales) {
        if (start + s.block_size >= num_keys && item + 1 < end) {
          const QueryRun next = runs[(item + 1) / s.num_kv_heads];
          const int64_t next_keys =  // its last row's
              keys_seen(query_start_loc, context_lens, next.seq, next.first + next.count - 1);
          prefetch_head(k_cache, block_tables + next.seq * s.table_stride,
                        (item + 1) % s.num_kv_heads, 0, next_keys);
        }
        for (int64_t v = 0; v < vectors; ++v) {
          const int64_t seen = std::min(count, keys_of(v) - start);
          if (seen <= 0) continue;
          float* weights = scores + v * score_stride + start;
          if (value_scales) {
            for (int64_t j = 0; j < seen; ++j) weights[j] *= value_scales[j * s.num_kv_heads];
          }
          accumulate_values(acc + v * D, weights, values, stride, seen, D);
        }
      });

      for (int64_t v = 0; v < vectors; ++v) {
        const float inv_sum = 1.f / sums[v];
        const int64_t t = run.first + v / group, head = first_head + v % group;
        scalar_t* ov = out + t * s.out_stride + head * D;
        for (int64_t d = 0; d < D; ++d) ov[d] = round_to<scalar_t>(acc[v * D + d] * inv_sum);
      }
    }
  });
}
