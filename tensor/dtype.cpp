#include "tensor/dtype.h"

namespace zg {

int64_t element_size(DType dtype) {
  switch (dtype) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::i8: case DType::boolean: return 1;
  }
  return 0;
}

const char* name(DType dtype) {
  switch (dtype) {
    case DType::f64: return "f64";
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i64: return "i64";
    case DType::i32: return "i32";
    case DType::i8: return "i8";
    case DType::boolean: return "bool";
  }
  return "?";
}

bool is_floating(DType dtype) {
  return dtype == DType::f64 || dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

bool is_integral(DType dtype) { return dtype == DType::i64 || dtype == DType::i32 || dtype == DType::i8; }

}  // namespace zg
