// Where a rank's rows of a sequence lie in the whole one. Context parallelism cuts each
// sequence into `parts` equal pieces and gives a rank some of them, side by side in the
// order `held` lists them -- the load-balanced causal split gives rank r of C the pieces r
// and 2C - 1 - r of 2C, one early and one late. Positions (a GPT's wpe, a Llama's rotary
// angles) and dropout masks are read from here, so a rank computes its rows of the one-rank
// model's activations.
#pragma once

#include <cstdint>
#include <vector>

namespace zg::nn {

struct SequencePieces {
  int parts = 1;
  std::vector<int> held = {0};

  bool whole() const { return parts == 1; }
  // A local sequence of `length` rows (held.size() pieces of length / held.size()) is a whole
  // one of this many rows. Throws zg::Error when the pieces do not divide `length`.
  int64_t whole_length(int64_t length) const;
  // These rows cut again into `count` equal parts, part `index` of them (sequence
  // parallelism's shard of a context-parallel rank's rows): the pieces that part is.
  // Throws zg::Error unless count divides the held pieces or they divide count.
  SequencePieces refine(int count, int index) const;
};

// The load-balanced causal split: rank r of `ranks` holds pieces r and 2 ranks - 1 - r.
SequencePieces load_balanced_pieces(int rank, int ranks);

}  // namespace zg::nn
