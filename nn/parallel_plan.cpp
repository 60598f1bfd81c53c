#include "nn/parallel_plan.h"

namespace zg::nn {

const char* name(ParallelStyle style) {
  switch (style) {
    case ParallelStyle::colwise: return "colwise";
    case ParallelStyle::rowwise: return "rowwise";
    case ParallelStyle::vocab_embedding: return "vocab_embedding";
    case ParallelStyle::copy_output: return "copy_output";
    case ParallelStyle::sequence_norm: return "sequence_norm";
    case ParallelStyle::scatter_input: return "scatter_input";
    case ParallelStyle::sequence_dropout: return "sequence_dropout";
  }
  return "?";
}

}  // namespace zg::nn
