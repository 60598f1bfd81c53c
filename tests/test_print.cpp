// Printing follows PyTorch's repr.
#include "helpers.h"

namespace zg::test {

TEST_CASE("tensors print like PyTorch") {
  CHECK(tensor<float>({1, 2, 3}).str() == "tensor([1., 2., 3.])");
  CHECK(tensor<float>({1.5, -2.25}).str() == "tensor([ 1.5000, -2.2500])");
  CHECK(tensor<int64_t>({1, 20, 3, 4}, {2, 2}).str() == "tensor([[ 1, 20],\n        [ 3,  4]])");
  CHECK(tensor<double>({0.5}, {}).str() == "tensor(0.5000, dtype=f64)");
  CHECK(tensor<bool>({true, false}).str() == "tensor([ True, False])");
  // Read through a double, INT64_MAX printed as 9223372036854775808.
  CHECK(tensor<int64_t>({INT64_MAX, INT64_MIN}).str() == "tensor([ 9223372036854775807, -9223372036854775808])");
  CHECK(tensor<float>({1e-5f, 1.0f}).str() == "tensor([1.0000e-05, 1.0000e+00])");
  CHECK(zeros({2, 1, 2}, DType::i32).str() == "tensor([[[0, 0]],\n\n        [[0, 0]]], dtype=i32)");
  CHECK(zeros({0}).str() == "tensor([])");
  CHECK(zeros({0, 3}).str() == "tensor([], size=(0, 3))");
  CHECK(tensor<float>({NAN, INFINITY, 1}).str() == "tensor([nan, inf, 1.])");
  const std::string big = arange(2000).str();
  CHECK(big == "tensor([   0,    1,    2,  ..., 1997, 1998, 1999])");
  CHECK(arange(0.0, 3000.0, 1.0, DType::f32).view({1000, 3}).str() ==
        "tensor([[   0.,    1.,    2.],\n        [   3.,    4.,    5.],\n        [   6.,    7.,    8.],\n"
        "        ...,\n        [2991., 2992., 2993.],\n        [2994., 2995., 2996.],\n        [2997., 2998., 2999.]])");
  std::ostringstream os;
  os << ones({1}, DType::bf16);
  CHECK(os.str() == "tensor([1.], dtype=bf16)");
}

}  // namespace zg::test
