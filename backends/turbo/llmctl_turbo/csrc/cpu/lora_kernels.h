// Multi-LoRA on the CPU: each adapted token's out row gets B[slot] @ (A[slot] @ x) added,
// after the base linear wrote it (shapes in kernels.h, lora_add). Included after
// tensor_kernels.h in each instruction-set namespace of cpu_kernels.cpp, like it.
//
// The step's adapted tokens come sorted by slot in tiles of one slot each (punica's
// segments; llmctl.engine.lora.slot_tiles): a tile reads its slot's A and B once for all
// its tokens, so a decode step of many requests over a few adapters reads each adapter
// once per tile, not once per token. Per tile, "shrink" h = A @ x (a dot product of K per
// rank row and token) then "expand" h @ Bt (B stored transposed, [R, N], so the expand
// sums over the rank in registers, a vector of output features at a time, with no
// reductions), the sum added to out with one rounding to the output type. Tiles run in
// parallel.
//
// Why a separate pass and not fused into the linear panels: the rank is small (flops of a
// few percent of the base product's), the shrink must finish before any output of the
// expand, and the panels' kernels are shared by every weight format (float, int8, GGUF
// blocks); one pass after each linear serves all of them unchanged.

// Tokens of a tile computed together: each load of A or Bt serves all of them, and their
// accumulators are independent chains of multiply-adds (one chain would wait on each
// add's latency). 8: the tiles' size (llmctl_turbo.lora.TILE_ROWS); 8 accumulators fit
// AVX2's 16 registers beside the loads.
constexpr int kLoraRows = 8;
// Rows of A (shrink) and vectors of output features (expand) per step of the tile: 2 where
// the register file holds 2 x 8 accumulators (AVX-512's 32 registers), else 1.
constexpr int kLoraUnroll = kTilePanels;

// a: [slots, parts * R, K]; bt: [slots, R, N], part p's features at columns
// b_offsets[p] .. + sizes[p] of bt, written to out's columns out_offsets[p] .. + sizes[p].
template <typename scalar_t>
void lora_add_rows(scalar_t* out, int64_t out_stride, const float* x, int64_t x_stride,
                   int64_t K, const float* a, const float* bt, int64_t R, int64_t N,
                   int64_t num_parts, const int64_t* out_offsets, const int64_t* b_offsets,
                   const int64_t* sizes, const int32_t* rows, const int32_t* tiles,
                   int64_t num_tiles) {
  const int64_t hr = num_parts * R;
  const int64_t first_tile_rows = tiles[2 * num_tiles] - tiles[num_tiles];
  const int64_t tile_work = (hr * K + R * N) * std::max<int64_t>(1, first_tile_rows);
  parallel_for(0, num_tiles, grain_for(tile_work), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> h;
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t slot = tiles[tile];
      const int64_t first = tiles[num_tiles + tile], last = tiles[2 * num_tiles + tile];
      const float* as = a + slot * hr * K;
      const float* bs = bt + slot * R * N;
      for (int64_t i0 = first; i0 < last; i0 += kLoraRows) {
        const int m = static_cast<int>(std::min<int64_t>(kLoraRows, last - i0));
        // Rows past the tile's end repeat its last token: computed, never stored.
        const float* xs[kLoraRows];
        scalar_t* os[kLoraRows];
        for (int q = 0; q < kLoraRows; ++q) {
          const int64_t row = rows[i0 + std::min(q, m - 1)];
          xs[q] = x + row * x_stride;
          os[q] = out + row * out_stride;
        }
        h.resize(kLoraRows * hr);
        // Shrink: h[q, j] = A[slot, j] . x[q], U rows of A at a time.
        auto shrink = [&](auto unroll, int64_t j) {
          constexpr int U = decltype(unroll)::value;
          FloatVec acc[U][kLoraRows] = {};
          int64_t k = 0;
          for (; k + kVectorWidth <= K; k += kVectorWidth) {
            FloatVec xv[kLoraRows];
            for (int q = 0; q < kLoraRows; ++q) xv[q] = load_vec(xs[q] + k);
            for (int u = 0; u < U; ++u) {
              const FloatVec av = load_vec(as + (j + u) * K + k);
              for (int q = 0; q < kLoraRows; ++q) acc[u][q] += av * xv[q];
            }
          }
          for (int u = 0; u < U; ++u) {
            const float* a_row = as + (j + u) * K;
            for (int q = 0; q < kLoraRows; ++q) {
              float sum = reduce_add(acc[u][q]);
              for (int64_t kk = k; kk < K; ++kk) sum += a_row[kk] * xs[q][kk];
              h[q * hr + j + u] = sum;
            }
          }
        };
        int64_t j = 0;
        for (; j + kLoraUnroll <= hr; j += kLoraUnroll) {
          shrink(std::integral_constant<int, kLoraUnroll>{}, j);
        }
        for (; j < hr; ++j) shrink(std::integral_constant<int, 1>{}, j);
        // Expand: out[q, part p] += h[q, p R ..] @ Bt[slot][:, part p], U vectors of output
        // features at a time, summed over the rank in registers.
        for (int64_t p = 0; p < num_parts; ++p) {
          const float* hp = h.data() + p * R;
          const float* b_part = bs + b_offsets[p];
          const int64_t size = sizes[p];
          auto expand = [&](auto unroll, int64_t c) {
            constexpr int U = decltype(unroll)::value;
            FloatVec acc[U][kLoraRows] = {};
            for (int64_t r = 0; r < R; ++r) {
              for (int u = 0; u < U; ++u) {
                const FloatVec bv = load_vec(b_part + r * N + c + u * kVectorWidth);
                for (int q = 0; q < kLoraRows; ++q) acc[u][q] += hp[q * hr + r] * bv;
              }
            }
            for (int q = 0; q < m; ++q) {
              scalar_t* o = os[q] + out_offsets[p] + c;
              for (int u = 0; u < U; ++u) {
                scalar_t* ou = o + u * kVectorWidth;
                if constexpr (std::is_same_v<scalar_t, float>) {
                  const FloatVec sum = load_vec(ou) + acc[u][q];
                  __builtin_memcpy(ou, &sum, sizeof(sum));
                } else {  // bf16 / fp16: widened, added, rounded one at a time
                  float sum[kVectorWidth];
                  __builtin_memcpy(sum, &acc[u][q], sizeof(sum));
                  for (int e = 0; e < kVectorWidth; ++e) {
                    ou[e] = round_to<scalar_t>(static_cast<float>(ou[e]) + sum[e]);
                  }
                }
              }
            }
          };
          int64_t c = 0;
          for (; c + kLoraUnroll * kVectorWidth <= size; c += kLoraUnroll * kVectorWidth) {
            expand(std::integral_constant<int, kLoraUnroll>{}, c);
          }
          for (; c + kVectorWidth <= size; c += kVectorWidth) {
            expand(std::integral_constant<int, 1>{}, c);
          }
          for (; c < size; ++c) {
            for (int q = 0; q < m; ++q) {
              float sum = 0.f;
              for (int64_t r = 0; r < R; ++r) sum += hp[q * hr + r] * b_part[r * N + c];
              scalar_t& value = os[q][out_offsets[p] + c];
              value = round_to<scalar_t>(static_cast<float>(value) + sum);
            }
          }
        }
      }
    }
  });
}

void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              at::IntArrayRef out_offsets, at::IntArrayRef sizes, const at::Tensor& rows,
              const at::Tensor& tiles) {
  if (tiles.size(1) == 0) return;
  int64_t x_stride;
  const float* xf = float_rows(x, x_stride);
  const int64_t num_parts = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> b_offsets(num_parts, 0);
  for (int64_t p = 1; p < num_parts; ++p) b_offsets[p] = b_offsets[p - 1] + sizes[p - 1];
  TURBO_DISPATCH_FLOAT_TYPES(out.scalar_type(), "lora_add", [&] {
    lora_add_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), xf, x_stride, x.size(1),
                            a.data_ptr<float>(), bt.data_ptr<float>(), bt.size(1), bt.size(2),
                            num_parts, out_offsets.data(), b_offsets.data(), sizes.data(),
                            rows.data_ptr<int32_t>(), tiles.data_ptr<int32_t>(), tiles.size(1));
  });
}
