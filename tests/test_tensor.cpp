// Tensor core: factories, views that share storage, conversions, 16-bit floats.
#include <cstring>

#include "helpers.h"
#include "tensor/backend.h"
#include "tensor/quantize.h"

namespace zg::test {

TEST_CASE("factories make the shapes, dtypes and values asked for") {
  CHECK(zeros({2, 3}).to_vector<float>() == std::vector<float>(6, 0.0f));
  CHECK(ones({4}, DType::f64).to_vector<double>() == std::vector<double>(4, 1.0));
  CHECK(full({2}, 7, DType::i32).to_vector<int32_t>() == std::vector<int32_t>{7, 7});
  CHECK(arange(5).to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4});
  CHECK(arange(1.0, 2.0, 0.25, DType::f32).to_vector<float>() == std::vector<float>{1, 1.25, 1.5, 1.75});
  CHECK(arange(3.0, 0.0, -1.0).to_vector<int64_t>() == std::vector<int64_t>{3, 2, 1});
  CHECK(arange(0).numel() == 0);
  CHECK(arange(0.0, 2.5).to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2});  // the end need not be whole
  // A value the dtype does not hold is refused, not truncated or saturated.
  CHECK_THROWS_WITH_AS(arange(0.0, 1.0, 0.25), "arange: the values from 0 by 0.25 to 0.75 do not all fit i64 (whole "
                       "numbers in its range; pass a floating-point dtype for fractions)", Error);
  CHECK_THROWS_AS(arange(0.5, 3.5), Error);
  CHECK_THROWS_WITH_AS(arange(0.0, 5e9, 2e9, DType::i32), "arange: the values from 0 by 2e+09 to 4e+09 do not all fit "
                       "i32 (whole numbers in its range; pass a floating-point dtype for fractions)", Error);
  CHECK_THROWS_AS(arange(0.0, 1e5, 7e4, DType::f16), Error);  // 70000 is inf in f16
  const Tensor t = tensor<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  CHECK(t.shape() == Shape{2, 3});
  CHECK(t.strides() == Shape{3, 1});
  CHECK(t.dtype() == DType::f32);
  CHECK(tensor<double>({1.5}, {}).item<double>() == 1.5);
  CHECK(tensor<int64_t>({1, 2}, {2}, DType::f16).dtype() == DType::f16);
  CHECK(zeros_like(t).shape() == t.shape());
  CHECK(full_like(t, 2).to_vector<float>()[5] == 2.0f);
  CHECK(empty({0, 3}).numel() == 0);
}

TEST_CASE("linspace and eye, as torch.linspace and torch.eye") {
  CHECK(linspace(0.0, 1.0, 5, DType::f64).to_vector<double>() == std::vector<double>{0, 0.25, 0.5, 0.75, 1});
  CHECK(linspace(3.0, -3.0, 4).to_vector<float>() == std::vector<float>{3, 1, -1, -3});
  CHECK(linspace(2.0, 7.0, 1).to_vector<float>() == std::vector<float>{2});
  CHECK(linspace(2.0, 7.0, 0).numel() == 0);
  CHECK(linspace(0.0, 10.0, 4, DType::i64).to_vector<int64_t>() == std::vector<int64_t>{0, 3, 6, 10});  // truncated
  const std::vector<double> fine = linspace(0.1, 0.7, 7, DType::f64).to_vector<double>();
  CHECK(fine.back() == 0.7);  // the end exactly: the second half is counted from it
  CHECK_THROWS_WITH_AS(linspace(0.0, 1.0, -1), "linspace: expected finite ends and steps >= 0, got start=0 end=1 steps=-1",
                       Error);
  CHECK_THROWS_AS(linspace(0.0, 1.0, 3, DType::boolean), Error);
  CHECK(eye(2, 3, DType::i64).to_vector<int64_t>() == std::vector<int64_t>{1, 0, 0, 0, 1, 0});
  CHECK(eye(3).shape() == Shape{3, 3});
  CHECK(eye(3).to_vector<float>() == std::vector<float>{1, 0, 0, 0, 1, 0, 0, 0, 1});
  CHECK(eye(0).numel() == 0);
  CHECK(eye(4, 2, TensorOptions(DType::bf16).device(kMeta)).shape() == Shape{4, 2});
  CHECK_THROWS_WITH_AS(eye(-1), "eye: expected n >= 0, got -1", Error);
}

TEST_CASE("broadcasting aligns shapes on the right; sizes match or are 1") {
  CHECK(broadcast_shapes({2, 1, 4}, {3, 1}, "t") == Shape{2, 3, 4});
  CHECK(broadcast_shapes({}, {3}, "t") == Shape{3});
  CHECK(broadcast_shapes({0}, {1}, "t") == Shape{0});
  CHECK(broadcast_shapes({5, 1}, {1, 0}, "t") == Shape{5, 0});
  CHECK_THROWS_WITH_AS(broadcast_shapes({2}, {3}, "t"), "t: cannot broadcast shapes [2] and [3]", Error);
  CHECK_THROWS_AS(broadcast_shapes({2, 3}, {3, 3}, "t"), Error);
  // A broadcast operand is read through stride-0 views, never copied.
  const Tensor row = tensor<float>({1, 2, 3});
  const Tensor col = tensor<float>({10, 20}, {2, 1});
  CHECK((row + col).to_vector<float>() == std::vector<float>{11, 12, 13, 21, 22, 23});
  CHECK((col * row).shape() == Shape{2, 3});
  CHECK(add(zeros({0, 3}), row).shape() == Shape{0, 3});
}

TEST_CASE("writing through a view changes the base") {
  const Tensor base = arange(0.0, 12.0, 1.0, DType::f32).view({3, 4});
  SUBCASE("select and fill") {
    base.select(0, 1).fill_(-1);
    CHECK(base.to_vector<float>() == std::vector<float>{0, 1, 2, 3, -1, -1, -1, -1, 8, 9, 10, 11});
  }
  SUBCASE("transposed view, copy_") {
    Tensor t = base.t();
    CHECK(!t.is_contiguous());
    t.narrow(0, 0, 1).copy_(tensor<float>({100, 200, 300}, {1, 3}));
    CHECK(base.to_vector<float>()[0] == 100);
    CHECK(base.to_vector<float>()[4] == 200);
    CHECK(base.to_vector<float>()[8] == 300);
  }
  SUBCASE("slice with a step") {
    Tensor every_other = base.view({-1}).slice(0, 1, 12, 2);
    CHECK(every_other.shape() == Shape{6});
    every_other.zero_();
    CHECK(base.to_vector<float>() == std::vector<float>{0, 0, 2, 0, 4, 0, 6, 0, 8, 0, 10, 0});
  }
  SUBCASE("reshape of a contiguous tensor is a view, of a transposed one a copy") {
    Tensor flat = base.reshape({12});
    CHECK(flat.storage() == base.storage());
    flat.fill_(3);
    CHECK(base.to_vector<float>() == std::vector<float>(12, 3.0f));
    Tensor copied = base.t().reshape({12});
    CHECK(copied.storage() != base.storage());
  }
  SUBCASE("data pointer of a view is the base's plus the offset") {
    const Tensor row = base.select(0, 2);
    CHECK(static_cast<float*>(row.data_ptr()) == base.data<float>() + 8);
  }
}

TEST_CASE("an in-place write whose source overlaps the destination reads the values from before the write") {
  // Before, the CPU read elements it had already overwritten: x.copy_(x.t()) gave a
  // half-transposed matrix and x[1:] += x[:-1] a running sum.
  for (const Device device : devices()) {
    INFO(device.str());
    const auto square = [&] { return arange(0.0, 9.0, 1.0, DType::f32).view({3, 3}).to(device); };
    Tensor x = square();
    x.copy_(x.t());
    CHECK(x.to_vector<float>() == std::vector<float>{0, 3, 6, 1, 4, 7, 2, 5, 8});
    const Tensor row = arange(0.0, 5.0, 1.0, DType::f32).to(device);
    row.narrow(0, 1, 4).add_(row.narrow(0, 0, 4));
    CHECK(row.to_vector<float>() == std::vector<float>{0, 1, 3, 5, 7});
    const Tensor shifted = arange(0.0, 5.0, 1.0, DType::f32).to(device);
    shifted.narrow(0, 0, 4).copy_(shifted.narrow(0, 1, 4));  // memmove's direction, the other way round
    CHECK(shifted.to_vector<float>() == std::vector<float>{1, 2, 3, 4, 4});
    Tensor y = square();
    y.add_(y);  // the same elements: no staging needed, and none wrong
    CHECK(y.to_vector<float>() == std::vector<float>{0, 2, 4, 6, 8, 10, 12, 14, 16});
    y.select(0, 0).copy_(y.select(1, 0));  // a row from a column: they share element 0
    CHECK(y.to_vector<float>() == std::vector<float>{0, 6, 12, 6, 8, 10, 12, 14, 16});
  }
}

TEST_CASE("view shapes and strides") {
  const Tensor x = zeros({2, 3, 4});
  CHECK(x.permute({2, 0, 1}).shape() == Shape{4, 2, 3});
  CHECK(x.permute({2, 0, 1}).strides() == Shape{1, 12, 4});
  CHECK(x.transpose(0, 2).strides() == Shape{1, 4, 12});
  CHECK(x.unsqueeze(1).shape() == Shape{2, 1, 3, 4});
  CHECK(x.unsqueeze(-1).shape() == Shape{2, 3, 4, 1});
  CHECK(x.unsqueeze(1).squeeze(1).shape() == x.shape());
  CHECK(zeros({1, 3, 1}).squeeze().shape() == Shape{3});
  CHECK(x.squeeze(0).shape() == x.shape());  // not size 1: unchanged
  CHECK(x.view({6, -1}).shape() == Shape{6, 4});
  CHECK(x.view({-1}).shape() == Shape{24});
  CHECK(x.narrow(2, 1, 2).shape() == Shape{2, 3, 2});
  CHECK(x.narrow(2, 1, 2).offset() == 1);
  CHECK(x.slice(1, -2, 100).shape() == Shape{2, 2, 4});
  CHECK(x.slice(2, 1, 4, 2).shape() == Shape{2, 3, 2});
  CHECK(x.slice(2, 1, 4, 2).strides() == Shape{12, 4, 2});
  // A step past the end keeps one element; before, end - start + step overflowed.
  CHECK(x.slice(2, 1, 4, INT64_MAX).shape() == Shape{2, 3, 1});
  const Tensor r = arange(0.0, 24.0, 1.0, DType::f32).view({2, 3, 4});
  CHECK(r.slice(2, 1, 4, INT64_MAX).contiguous().to_vector<float>() == r.select(2, 1).contiguous().to_vector<float>());
  CHECK(x.slice(2, 3, 1).shape() == Shape{2, 3, 0});
  CHECK(zeros({3, 1}).expand({2, 3, 4}).strides() == Shape{0, 1, 0});
  CHECK(zeros({3, 1}).expand({-1, 5}).shape() == Shape{3, 5});
  // Splitting a dim of a transposed tensor is still a view; merging across the transpose is not.
  const Tensor p = zeros({4, 6}).t();  // [6, 4], strides [1, 6]
  CHECK(p.view({2, 3, 4}).strides() == Shape{3, 1, 6});
  CHECK_THROWS_AS(p.view({24}), Error);
  CHECK(zeros({2, 3}).t().contiguous().is_contiguous());
  CHECK(zeros({2, 3}).t().contiguous().strides() == Shape{2, 1});
}

TEST_CASE("conversions: dtype, item, to_vector, clone") {
  const Tensor x = tensor<float>({1.5f, -2.25f, 3.0f});
  CHECK(x.to(DType::f64).to_vector<double>() == std::vector<double>{1.5, -2.25, 3.0});
  CHECK(x.to(DType::i64).to_vector<int64_t>() == std::vector<int64_t>{1, -2, 3});
  CHECK(x.to(DType::boolean).to_vector<bool>() == std::vector<bool>{true, true, true});
  CHECK(x.to(DType::f32).is_same(x));
  CHECK(x.to(kCPU).is_same(x));
  CHECK(x.select(0, 1).item<double>() == -2.25);
  Tensor c = x.clone();
  c.fill_(0);
  CHECK(x.to_vector<float>()[0] == 1.5f);
  CHECK(x.to_vector<int32_t>() == std::vector<int32_t>{1, -2, 3});
}

TEST_CASE("f16 and bf16 round to nearest even and keep specials") {
  CHECK(Half(1.0f).bits == 0x3c00);
  CHECK(Half(65504.0f).bits == 0x7bff);  // largest finite half
  CHECK(Half(65520.0f).bits == 0x7c00);  // rounds to inf
  CHECK(Half(-0.0f).bits == 0x8000);
  CHECK(Half(5.960464477539063e-08f).bits == 0x0001);  // smallest subnormal
  CHECK(Half(2.9802322387695312e-08f).bits == 0x0000);  // half-way to it: ties to even (0)
  CHECK(Half(1.0f + 1.0f / 2048).bits == 0x3c00);       // tie between 0x3c00 and 0x3c01 -> even
  CHECK(Half(1.0f + 3.0f / 2048).bits == 0x3c02);       // tie between 0x3c01 and 0x3c02 -> even
  CHECK(std::isnan(static_cast<float>(Half(NAN))));
  CHECK(static_cast<float>(Half::to_float(0x0001)) == 5.960464477539063e-08f);
  CHECK(BFloat16(1.0f).bits == 0x3f80);
  CHECK(BFloat16(1.0f + 1.0f / 256).bits == 0x3f80);  // tie -> even
  CHECK(BFloat16(1.0f + 3.0f / 256).bits == 0x3f82);
  CHECK(std::isnan(static_cast<float>(BFloat16(NAN))));
  CHECK(static_cast<float>(BFloat16(3.0e38f)) == doctest::Approx(3.0e38f).epsilon(1e-2));
  // Every f16 value survives a round trip through f32.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = Half::to_float(h);
    if (std::isnan(f)) continue;
    REQUIRE(Half::from_float(f) == h);
  }
  const Tensor x = tensor<float>({0.1f, 1000.0f, -3.5f});
  CHECK(x.to(DType::bf16).to(DType::f32).to_vector<float>()[2] == -3.5f);
  CHECK(x.to(DType::f16).to_vector<float>()[0] == doctest::Approx(0.1f).epsilon(1e-3));
}

TEST_CASE("a released storage throws on use and comes back when materialised") {
  Tensor unit = zeros({8});
  const Tensor view = unit.narrow(0, 2, 4);
  unit.storage()->release();
  CHECK(view.storage()->is_released());
  CHECK_THROWS_WITH_AS(view.data_ptr(), doctest::Contains("was released; materialize it"), Error);
  CHECK_THROWS_AS(view.to_vector<float>(), Error);
  unit.storage()->materialize();
  unit.fill_(2);
  CHECK(view.to_vector<float>() == std::vector<float>(4, 2.0f));
}

// Each element of `x` against its dequantized value: within half its block's scale, to
// the rounding of the f32 quotient and product (a few ulp of the block's max) and of the
// result to x's dtype (half an ulp of bf16: 2^-8 of it).
static void check_within_block_bound(const Tensor& x, const Quantized& q) {
  const double rounding = x.dtype() == DType::bf16 ? 0x1p-8 : 0;
  const std::vector<double> want = x.to_vector<double>(), got = dequantize(q).to_vector<double>();
  const std::vector<float> scales = q.scales.to_vector<float>();
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const double scale = scales[i / static_cast<size_t>(q.block)];
    INFO("element " << i << ": " << want[i] << " came back " << got[i] << " (scale " << scale << ")");
    CHECK(std::fabs(got[i] - want[i]) <= scale / 2 + 127 * scale * 0x1p-22 + std::fabs(got[i]) * rounding);
  }
}

TEST_CASE("quantize: blockwise int8 and int4 round trip within half a block's scale, for random and adversarial blocks") {
  manual_seed(5);
  for (const int bits : {8, 4}) {
    const int top = bits == 8 ? 127 : 7;
    for (DType dtype : {DType::f32, DType::bf16, DType::f64}) {
      INFO(bits << " bits, " << name(dtype));
      // Random values of different magnitude per block; a shorter last block (5000 = 2 x 2048 + 904).
      const Tensor x = (randn({5000}, dtype) * (arange(5000.0, DType::f64) / 512.0 + 0.01).to(dtype)).to(dtype);
      const Quantized q = quantize(x, bits);
      CHECK(q.values.dtype() == DType::i8);
      CHECK(q.scales.numel() == 3);
      CHECK(q.nbytes() == 5000 * bits / 8 + 3 * 4);
      CHECK(dequantize(q).dtype() == dtype);
      check_within_block_bound(x, q);
    }
    // A block of zeros has scale 0 and comes back zeros; a block with one huge value keeps it
    // exactly (q = +-L) while the small ones go to zero, within the bound; shapes come back.
    Tensor adversarial = zeros({2, 64});
    adversarial.narrow(0, 1, 1).copy_(randn({1, 64}) * 1e-3);
    adversarial.narrow(1, 40, 1).narrow(0, 1, 1).fill_(-3e4);
    const Quantized q = quantize(adversarial, bits, 64);
    CHECK(q.scales.to_vector<float>()[0] == 0.0f);
    CHECK(q.scales.to_vector<float>()[1] == 30000.0f / static_cast<float>(top));
    CHECK(dequantize(q).shape() == Shape{2, 64});
    CHECK(dequantize(q).narrow(0, 0, 1).to_vector<float>() == std::vector<float>(64, 0.0f));
    CHECK(dequantize(q).to_vector<float>()[64 + 40] == -3e4f);
    // Element 104 at 8 bits is byte 104; at 4 bits the low nibble of byte 52: -7 is 0b1001.
    CHECK(q.values.to_vector<int32_t>()[bits == 8 ? 104 : 52] == (bits == 8 ? -127 : 9));
    check_within_block_bound(adversarial, q);
    // A strided view quantizes its own elements; at 4 bits an odd count gets a zero to fill its byte.
    check_within_block_bound(adversarial.transpose(0, 1), quantize(adversarial.transpose(0, 1), bits, bits == 8 ? 7 : 8));
    const Tensor odd = randn({3, 5});
    check_within_block_bound(odd, quantize(odd, bits, 4));
  }
}

TEST_CASE("dequantize_blocks over segments (an all-gather's shards, each quantized by its rank) in one pass") {
  // Three shards of 1000 quantized on their own in blocks of 384 (3 scales each: 384, 384, 232).
  manual_seed(9);
  const Tensor x = randn({3000});
  for (const int bits : {8, 4}) {
    std::vector<Tensor> values, scales, each;
    for (int r = 0; r < 3; ++r) {
      const Quantized q = quantize(x.narrow(0, 1000 * r, 1000), bits, 384);
      values.push_back(q.values), scales.push_back(q.scales), each.push_back(dequantize(q));
    }
    const Tensor all_values = cat(values, 0), all_scales = cat(scales, 0), out = empty({3000});
    backend(kCPU).dequantize_blocks(all_values, all_scales, bits, 384, 1000, out);
    CHECK(max_abs_diff(out, cat(each, 0)) == 0.0);
    // The layout is checked: a segment that does not divide the elements, scales of another count.
    CHECK_THROWS_WITH_AS(backend(kCPU).dequantize_blocks(all_values, all_scales, bits, 384, 999, out),
                         doctest::Contains("the segment (where blocks restart) must be positive"), Error);
    CHECK_THROWS_WITH_AS(backend(kCPU).dequantize_blocks(all_values, all_scales, bits, 384, 3000, out),
                         doctest::Contains("the scales must be a contiguous [8] f32 tensor"), Error);
  }
  const Tensor q4 = empty({1500}, DType::i8), scales = empty({3});
  CHECK_THROWS_WITH_AS(backend(kCPU).dequantize_blocks(q4, scales, 4, 383, 1000, x),
                       "dequantize: the block must be positive and even at 4 bits, got 383", Error);
  CHECK_THROWS_WITH_AS(backend(kCPU).dequantize_blocks(empty({3000}, DType::i8), scales, 4, 1000, 3000, x),
                       doctest::Contains("the quantized values must be a contiguous [1500] i8 tensor (4 bits an element)"),
                       Error);
}

TEST_CASE("quantize refuses non-finite values, integer tensors, a block below one and bits other than 8 or 4") {
  Tensor x = ones({10});
  x.narrow(0, 7, 1).fill_(NAN);
  CHECK_THROWS_WITH_AS(quantize(x), doctest::Contains("quantize: element 7 of f32[10] on cpu is nan; only "
                                                      "finite values quantize"), Error);
  x.narrow(0, 7, 1).fill_(INFINITY);
  CHECK_THROWS_WITH_AS(quantize(x, 4), doctest::Contains("element 7"), Error);
  CHECK_THROWS_WITH_AS(quantize(arange(4)), doctest::Contains("quantize: expected a floating tensor, got i64"), Error);
  CHECK_THROWS_WITH_AS(quantize(ones({4}), 8, 0), "quantize: the block must be positive, got 0", Error);
  CHECK_THROWS_WITH_AS(quantize(ones({4}), 4, 3), "quantize: the block must be positive and even at 4 bits, got 3",
                       Error);
  CHECK_THROWS_WITH_AS(quantize(ones({4}), 2), "quantize: quantizes to 8 or 4 bits, not 2", Error);
}

}  // namespace zg::test
