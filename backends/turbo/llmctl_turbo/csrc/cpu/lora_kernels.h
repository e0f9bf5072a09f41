// Multi-LoRA on the CPU: each adapted token's out row gets B[slot] @ (A[slot] @ x) added,
// after the base linear wrote it (shapes in kernels.h, lora_add). Included after
// tensor_kernels.h in each instruction-set namespace of cpu_kernels.cpp, like it.
//
// The step's adapted tokens come sorted by slot in tiles of one slot each (punica's
// segments; llmctl.engine.lora.slot_tiles): a tile reads its slot's A and B once for all
// its tokens, so a decode step of many requests over a few adapters reads each adapter
// once per tile, not once per token. Per tile, "shrink" h = A @ x (a dot product of K per
// rank row and token) then "expand" delta += h[r] * Bt[r] (B stored transposed, [R, N], so
// the expand is a vector multiply-add along the output features, no reductions), and the
// delta is added to out with one rounding to the output type. Tiles run in parallel.
//
// Why a separate pass and not fused into the linear panels: the rank is small (flops of a
// few percent of the base product's), the shrink must finish before any output of the
// expand, and the panels' kernels are shared by every weight format (float, int8, GGUF
// blocks); one pass after each linear serves all of them unchanged.

// y[0..n) += alpha * x[0..n)
inline void add_scaled(float* y, const float* x, float alpha, int64_t n) {
  int64_t i = 0;
  const FloatVec a = FloatVec{} + alpha;
  for (; i + kVectorWidth <= n; i += kVectorWidth) {
    const FloatVec sum = load_vec(y + i) + a * load_vec(x + i);
    __builtin_memcpy(y + i, &sum, sizeof(sum));
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// a: [slots, parts * R, K]; bt: [slots, R, N], part p's features at columns
// b_offsets[p] .. + sizes[p] of bt, written to out's columns out_offsets[p] .. + sizes[p].
template <typename scalar_t>
void lora_add_rows(scalar_t* out, int64_t out_stride, const float* x, int64_t x_stride,
                   int64_t K, const float* a, const float* bt, int64_t R, int64_t N,
                   int64_t num_parts, const int64_t* out_offsets, const int64_t* b_offsets,
                   const int64_t* sizes, const int32_t* rows, const int32_t* tiles,
                   int64_t num_tiles) {
  const int64_t hr = num_parts * R;
  const int64_t tile_work = (hr * K + R * N) * std::max<int64_t>(1, tiles[2 * num_tiles] - tiles[num_tiles]);
  parallel_for(0, num_tiles, grain_for(tile_work), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> h, delta;
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t slot = tiles[tile];
      const int32_t* tile_rows = rows + tiles[num_tiles + tile];
      const int64_t n = tiles[2 * num_tiles + tile] - tiles[num_tiles + tile];
      h.resize(n * hr);
      delta.assign(n * N, 0.f);
      // Shrink: each row of A[slot] read once for the tile's tokens.
      const float* as = a + slot * hr * K;
      for (int64_t j = 0; j < hr; ++j) {
        for (int64_t i = 0; i < n; ++i) {
          h[i * hr + j] = dot(as + j * K, x + tile_rows[i] * x_stride, K);
        }
      }
      // Expand: each row of Bt[slot] read once, every part from its own rank rows of h.
      const float* bs = bt + slot * R * N;
      for (int64_t p = 0; p < num_parts; ++p) {
        for (int64_t r = 0; r < R; ++r) {
          const float* b_row = bs + r * N + b_offsets[p];
          for (int64_t i = 0; i < n; ++i) {
            add_scaled(delta.data() + i * N + b_offsets[p], b_row, h[i * hr + p * R + r],
                       sizes[p]);
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        scalar_t* o = out + tile_rows[i] * out_stride;
        const float* d = delta.data() + i * N;
        for (int64_t p = 0; p < num_parts; ++p) {
          for (int64_t c = 0; c < sizes[p]; ++c) {
            scalar_t& value = o[out_offsets[p] + c];
            value = round_to<scalar_t>(static_cast<float>(value) + d[b_offsets[p] + c]);
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
