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
  // Whole numbers too go scientific when they span more than 1e3 (of what is shown).
  CHECK(arange(0.0, 3000.0, 1.0, DType::f32).view({1000, 3}).str() ==
        "tensor([[0.0000e+00, 1.0000e+00, 2.0000e+00],\n        [3.0000e+00, 4.0000e+00, 5.0000e+00],\n"
        "        [6.0000e+00, 7.0000e+00, 8.0000e+00],\n        ...,\n"
        "        [2.9910e+03, 2.9920e+03, 2.9930e+03],\n        [2.9940e+03, 2.9950e+03, 2.9960e+03],\n"
        "        [2.9970e+03, 2.9980e+03, 2.9990e+03]])");
  CHECK(tensor<float>({123456, 1}).str() == "tensor([1.2346e+05, 1.0000e+00])");
  // Rows wrap at 80 characters, indented under their bracket (torch's linewidth).
  CHECK(arange(0.0, 40.0, 1.0, DType::f32).str() ==
        "tensor([ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.,\n"
        "        14., 15., 16., 17., 18., 19., 20., 21., 22., 23., 24., 25., 26., 27.,\n"
        "        28., 29., 30., 31., 32., 33., 34., 35., 36., 37., 38., 39.])");
  CHECK((arange(0.0, 20.0, 1.0, DType::f32).view({1, 20}) * 1.5).str() ==
        "tensor([[ 0.0000,  1.5000,  3.0000,  4.5000,  6.0000,  7.5000,  9.0000, 10.5000,\n"
        "         12.0000, 13.5000, 15.0000, 16.5000, 18.0000, 19.5000, 21.0000, 22.5000,\n"
        "         24.0000, 25.5000, 27.0000, 28.5000]])");
  std::ostringstream os;
  os << ones({1}, DType::bf16);
  CHECK(os.str() == "tensor([1.], dtype=bf16)");
}

}  // namespace zg::test
