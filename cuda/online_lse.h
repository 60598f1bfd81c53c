// log(sum_j exp(x_j)) in one pass over x (Milakov and Gimelshein's online softmax): keep
// the largest x so far and the sum of exp(x - largest) so far; a new largest rescales the
// sum by exp(old - new). Partial results merge the same way, so each thread folds its
// share of a row and a block's tree merges the threads'. The cross-entropy forward reads
// a [rows, vocabulary] logits buffer once instead of twice (max, then sum).
//
// Where the two-pass form (max, then sum of exp(x - max)) is NaN, so is this: a NaN, or
// a +inf (whose own term is exp(inf - inf)). A -inf adds exp(-inf) = 0, so it is skipped
// (folded in first, it would make exp(-inf - -inf) = NaN). A row of -inf only has
// sum 0 and lse = -inf: its cross-entropy, -inf - -inf, is NaN all the same.
// Plain C++, so a host test checks it (std::exp and std::log of a float are float on
// the device too).
#pragma once

#include <cmath>
#include <limits>

#include "tensor/host_device.h"

namespace zg::cuda {

template <class C>
struct OnlineLse {
  C max = -std::numeric_limits<C>::infinity();
  C sum = 0;  // of exp(x - max) over the x folded in

  ZG_HOST_DEVICE void add(C x) {
    if (x == -std::numeric_limits<C>::infinity()) return;
    if (x > max) {
      sum = sum * std::exp(max - x) + std::exp(x - x);  // exp(x - x): 1, or NaN for x = +inf
      max = x;
    } else {
      sum += std::exp(x - max);  // NaN for a NaN x
    }
  }
  // This and `other` folded together (deterministic for a given order of merges).
  ZG_HOST_DEVICE OnlineLse merged(const OnlineLse& other) const {
    const OnlineLse& high = other.max > max ? other : *this;
    const OnlineLse& low = other.max > max ? *this : other;
    OnlineLse out = high;
    // low.max == -inf: nothing but NaNs was folded into low (its sum is 0 or NaN).
    out.sum += low.max == -std::numeric_limits<C>::infinity() ? low.sum : low.sum * std::exp(low.max - high.max);
    return out;
  }
  ZG_HOST_DEVICE C log_sum() const { return std::log(sum); }
};

}  // namespace zg::cuda
