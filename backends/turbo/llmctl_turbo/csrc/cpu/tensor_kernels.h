// The tensor entry points of the CPU kernels (shapes were checked by the caller; see
// kernels.h): unpack pointers and strides, pick the row kernel for the storage type.
// Included after row_kernels.h in each instruction-set namespace of cpu_kernels.cpp.

// x as fp32 rows: x itself when it is fp32, else converted once into a per-thread buffer.
inline const float* float_rows(const at::Tensor& x, int64_t& stride) {
  if (x.scalar_type() == at::kFloat) {
    stride = x.stride(0);
    return x.data_ptr<float>();
  }
  thread_local std::vector<float> buffer;
  const int64_t rows = x.size(0), cols = x.size(1);
  buffer.resize(rows * cols);
  float* converted = buffer.data();
  TURBO_DISPATCH_FLOAT_TYPES(x.scalar_type(), "float_rows", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    const int64_t in_stride = x.stride(0);
    parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < cols; ++i) converted[r * cols + i] = static_cast<float>(in[r * in_stride + i]);
      }
    });
  });
  stride = cols;
  return converted;
}

// fn(layout) for a GGUF block weight (uint8, block_kernels.h), its layout (block_layout.h)
// a compile-time constant named by the packed weight's bytes per 32 inputs.
template <typename Fn>
inline void on_block_layout(const at::Tensor& packed, const Fn& fn) {
  switch (layout_of_packed_bytes(packed.size(2))) {
    case kLayoutQ4:
      return fn(std::integral_constant<int, kLayoutQ4>{});
    case kLayoutQ8:
      return fn(std::integral_constant<int, kLayoutQ8>{});
    case kLayoutQ4K:
      return fn(std::integral_constant<int, kLayoutQ4K>{});
    case kLayoutQ5K:
      return fn(std::integral_constant<int, kLayoutQ5K>{});
    case kLayoutQ6K:
      return fn(std::integral_constant<int, kLayoutQ6K>{});
    case kLayoutQ4Z:
      return fn(std::integral_constant<int, kLayoutQ4Z>{});
    case kLayoutQ8Z:
      return fn(std::integral_constant<int, kLayoutQ8Z>{});
  }
  TORCH_CHECK(false, "not a packed GGUF block weight: ", packed.size(2), " bytes per block");
}

// The packed weight is the activations' type, int8 with float32 scales (else empty), or
// GGUF blocks (uint8, no scales: they are inside the blocks).
void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
            const at::Tensor& bias, const at::Tensor& scale, int64_t* argmax) {
  int64_t x_stride;
  const float* xf = float_rows(x, x_stride);
  TURBO_DISPATCH_LINEAR_TYPES(out.scalar_type(), "linear", [&] {
    const scalar_t* b = bias.numel() ? bias.data_ptr<scalar_t>() : nullptr;
    if (packed.scalar_type() == at::kByte) {
      on_block_layout(packed, [&](auto layout) {
        block_linear_rows<decltype(layout)::value, scalar_t>(
            out.data_ptr<scalar_t>(), out.stride(0), xf, x_stride, x.size(0), x.size(1),
            packed.data_ptr<uint8_t>(), out.size(1), b, argmax);
      });
    } else if (packed.scalar_type() == at::kChar) {
      linear_rows<int8_t, scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), xf, x_stride,
                                    x.size(0), x.size(1), packed.data_ptr<int8_t>(),
                                    out.size(1), b, scale.data_ptr<float>(), argmax);
    } else {
      linear_rows<scalar_t, scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), xf, x_stride,
                                      x.size(0), x.size(1), packed.data_ptr<scalar_t>(),
                                      out.size(1), b, nullptr, argmax);
    }
  });
}

void linear_silu_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scale) {
  int64_t x_stride;
  const float* xf = float_rows(x, x_stride);
  TURBO_DISPATCH_LINEAR_TYPES(out.scalar_type(), "linear_silu_mul", [&] {
    if (packed.scalar_type() == at::kByte) {
      on_block_layout(packed, [&](auto layout) {
        block_linear_silu_mul_rows<decltype(layout)::value, scalar_t>(
            out.data_ptr<scalar_t>(), out.stride(0), xf, x_stride, x.size(0), x.size(1),
            packed.data_ptr<uint8_t>(), out.size(1));
      });
    } else if (packed.scalar_type() == at::kChar) {
      linear_silu_mul_rows<int8_t, scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), xf,
                                             x_stride, x.size(0), x.size(1),
                                             packed.data_ptr<int8_t>(), out.size(1),
                                             scale.data_ptr<float>());
    } else {
      linear_silu_mul_rows<scalar_t, scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), xf,
                                               x_stride, x.size(0), x.size(1),
                                               packed.data_ptr<scalar_t>(), out.size(1),
                                               nullptr);
    }
  });
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TURBO_DISPATCH_FLOAT_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.data_ptr<scalar_t>(),
                            x.stride(0), nullptr, 0, weight.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), static_cast<float>(eps));
  });
}

void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x,
                  const at::Tensor& weight, double eps) {
  TURBO_DISPATCH_FLOAT_TYPES(x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.data_ptr<scalar_t>(),
                            x.stride(0), residual.data_ptr<scalar_t>(), residual.stride(0),
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& cos_sin_cache) {
  TURBO_DISPATCH_FLOAT_TYPES(q.scalar_type(), "rotary_embedding", [&] {
    rotary_rows<scalar_t>(positions.data_ptr<int32_t>(), q.data_ptr<scalar_t>(), q.stride(0),
                          q.size(1), k.data_ptr<scalar_t>(), k.stride(0), k.size(1),
                          cos_sin_cache.data_ptr<float>(), q.size(0), q.size(2));
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  TURBO_DISPATCH_FLOAT_TYPES(out.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0),
                                gate_up.data_ptr<scalar_t>(), gate_up.stride(0), out.size(0),
                                out.size(1));
  });
}

// k and v of tokens [begin, end) written to their slots, on this thread. An int8 cache
// (kv_cache_dtype=int8) comes with its scales; a float one with none.
template <typename scalar_t>
void write_kv_tokens(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                     at::Tensor& v_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t begin,
                     int64_t end) {
  const scalar_t* k = key.data_ptr<scalar_t>() + begin * key.stride(0);
  const scalar_t* v = value.data_ptr<scalar_t>() + begin * value.stride(0);
  const int32_t* slots = slot_mapping.data_ptr<int32_t>() + begin;
  if (k_cache.scalar_type() == at::kChar) {
    write_kv_rows_int8<scalar_t>(k, key.stride(0), v, value.stride(0),
                                 k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                                 k_scale.data_ptr<float>(), v_scale.data_ptr<float>(), slots,
                                 end - begin, key.size(1), key.size(2));
  } else {
    write_kv_rows<scalar_t>(k, key.stride(0), v, value.stride(0), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), slots, end - begin,
                            key.size(1) * key.size(2));
  }
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TURBO_DISPATCH_FLOAT_TYPES(key.scalar_type(), "write_kv_cache", [&] {
    const int64_t work = 2 * key.size(1) * key.size(2);
    parallel_for(0, key.size(0), grain_for(work), [&](int64_t begin, int64_t end) {
      write_kv_tokens<scalar_t>(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                                begin, end);
    });
  });
}

// rotary_embedding, then write_kv_cache of the rotated k and of v, in one parallel loop
// over the tokens: a prompt's thousands of rows are split across the threads, where a
// serial write kept the other thread waiting long enough to fall asleep.
void rotary_embedding_and_write_kv(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                   at::Tensor& k_cache, at::Tensor& v_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                   const at::Tensor& v_scale) {
  TURBO_DISPATCH_FLOAT_TYPES(q.scalar_type(), "rotary_embedding_and_write_kv", [&] {
    const int64_t work = (q.size(1) + 2 * k.size(1)) * q.size(2);
    parallel_for(0, q.size(0), grain_for(work), [&](int64_t begin, int64_t end) {
      // rotary_rows' own parallel loop runs on this thread, nested.
      rotary_rows<scalar_t>(positions.data_ptr<int32_t>() + begin,
                            q.data_ptr<scalar_t>() + begin * q.stride(0), q.stride(0),
                            q.size(1), k.data_ptr<scalar_t>() + begin * k.stride(0),
                            k.stride(0), k.size(1), cos_sin_cache.data_ptr<float>(),
                            end - begin, q.size(2));
      write_kv_tokens<scalar_t>(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, begin,
                                end);
    });
  });
}

// The sizes and strides the attention kernels take (AttentionShape, cpu_kernels.cpp).
inline AttentionShape attention_shape(const at::Tensor& out, const at::Tensor& q,
                                      const at::Tensor& k_cache, const at::Tensor& block_tables,
                                      const at::Tensor& context_lens) {
  return {context_lens.size(0), q.size(0),     q.size(1),    k_cache.size(2),
          q.size(2),            k_cache.size(1), q.stride(0), out.stride(0),
          block_tables.stride(0)};
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     double scale, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  const AttentionShape shape = attention_shape(out, q, k_cache, block_tables, context_lens);
  TURBO_DISPATCH_FLOAT_TYPES(q.scalar_type(), "paged_attention", [&] {
    auto run = [&](const auto* k_rows, const auto* v_rows, const float* ks, const float* vs) {
      paged_attention_rows(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k_rows, v_rows, ks,
                           vs, block_tables.data_ptr<int32_t>(),
                           query_start_loc.data_ptr<int32_t>(),
                           context_lens.data_ptr<int32_t>(), shape, static_cast<float>(scale));
    };
    if (k_cache.scalar_type() == at::kChar) {
      run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), k_scale.data_ptr<float>(),
          v_scale.data_ptr<float>());
    } else {
      run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), nullptr, nullptr);
    }
  });
}

bool rope_write_and_decode_attention(at::Tensor& out, const at::Tensor& positions,
                                     const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                     at::Tensor& k_cache, at::Tensor& v_cache,
                                     const at::Tensor& slot_mapping,
                                     const at::Tensor& block_tables,
                                     const at::Tensor& query_start_loc,
                                     const at::Tensor& context_lens, double scale) {
  if (k_cache.scalar_type() != q.scalar_type()) return false;  // an int8 cache
  const AttentionShape shape = attention_shape(out, q, k_cache, block_tables, context_lens);
  bool done = false;
  TURBO_DISPATCH_FLOAT_TYPES(q.scalar_type(), "rope_write_and_decode_attention", [&] {
    const NewTokens<scalar_t> fresh{positions.data_ptr<int32_t>(),
                                    cos_sin_cache.data_ptr<float>(),
                                    slot_mapping.data_ptr<int32_t>(),
                                    k.data_ptr<scalar_t>(),
                                    k.stride(0),
                                    v.data_ptr<scalar_t>(),
                                    v.stride(0),
                                    k_cache.data_ptr<scalar_t>(),
                                    v_cache.data_ptr<scalar_t>()};
    done = narrow_attention(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                            k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int32_t>(),
                            query_start_loc.data_ptr<int32_t>(),
                            context_lens.data_ptr<int32_t>(), shape, static_cast<float>(scale),
                            &fresh);
  });
  return done;
}
