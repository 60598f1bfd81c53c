// einsum by one general path: operands are contracted left to right, each pair as one
// batched matmul -- both permuted to [batch, kept, summed] / [batch, summed, kept] and
// reshaped to three dims -- after the letters nothing later needs are summed out of each.
// A single operand is a sum and a permute. Gradients are those of sum, permute, reshape
// and matmul.
#include <algorithm>
#include <cctype>
#include <map>

#include "autograd/functions.h"
#include "tensor/checks.h"

namespace zg {

namespace {

bool has(const std::string& letters, char c) { return letters.find(c) != std::string::npos; }

// An operand with one letter per dim.
struct Term {
  Tensor t;
  std::string letters;
};

// The letters of `from` that satisfy keep, in order.
template <class Keep>
std::string letters_where(const std::string& from, Keep keep) {
  std::string out;
  for (char c : from)
    if (keep(c)) out += c;
  return out;
}

// The term summed over its letters not in `needed`.
Term sum_out(const Term& term, const std::string& needed) {
  Shape dims;
  for (size_t i = 0; i < term.letters.size(); ++i)
    if (!has(needed, term.letters[i])) dims.push_back(static_cast<int64_t>(i));
  if (dims.empty()) return term;
  return {sum(term.t, dims), letters_where(term.letters, [&](char c) { return has(needed, c); })};
}

// The term's dims in the order of `order` (a permutation of its letters).
Tensor arranged(const Term& term, const std::string& order) {
  Shape dims;
  for (char c : order) dims.push_back(static_cast<int64_t>(term.letters.find(c)));
  return term.t.permute(dims);
}

// The product of the sizes of the term's dims named by `letters`.
int64_t size_of(const Term& term, const std::string& letters) {
  int64_t n = 1;
  for (char c : letters) n *= term.t.size(static_cast<int64_t>(term.letters.find(c)));
  return n;
}

// a and b contracted over their shared letters that `later` does not need: one batched matmul
// [batch, M, K] x [batch, K, N], batch the shared letters still needed.
Term contract(Term a, Term b, const std::string& later) {
  a = sum_out(a, later + b.letters);
  b = sum_out(b, later + a.letters);
  const std::string batch = letters_where(a.letters, [&](char c) { return has(b.letters, c) && has(later, c); });
  const std::string summed = letters_where(a.letters, [&](char c) { return has(b.letters, c) && !has(later, c); });
  const std::string a_only = letters_where(a.letters, [&](char c) { return !has(b.letters, c); });
  const std::string b_only = letters_where(b.letters, [&](char c) { return !has(a.letters, c); });
  const int64_t nb = size_of(a, batch), m = size_of(a, a_only), k = size_of(a, summed), n = size_of(b, b_only);
  const Tensor product = matmul(arranged(a, batch + a_only + summed).reshape({nb, m, k}),
                                arranged(b, batch + summed + b_only).reshape({nb, k, n}));
  Shape shape;
  for (char c : batch + a_only) shape.push_back(a.t.size(static_cast<int64_t>(a.letters.find(c))));
  for (char c : b_only) shape.push_back(b.t.size(static_cast<int64_t>(b.letters.find(c))));
  return {product.reshape(shape), batch + a_only + b_only};
}

}  // namespace

Tensor einsum(const std::string& equation, const std::vector<Tensor>& operands) {
  std::string spec;
  for (char c : equation)
    if (c != ' ') spec += c;
  ZG_CHECK(spec.find("...") == std::string::npos, "einsum: \"", equation,
           "\": ellipsis ('...') is not supported; name every dim with a letter");
  const size_t arrow = spec.find("->");
  std::vector<std::string> inputs(1);
  for (char c : spec.substr(0, arrow)) {
    if (c == ',') inputs.emplace_back();
    else inputs.back() += c;
  }
  ZG_CHECK(inputs.size() == operands.size(), "einsum: \"", equation, "\" names ", inputs.size(), " operands, got ",
           operands.size());
  std::map<char, int64_t> sizes, uses;
  for (size_t i = 0; i < operands.size(); ++i) {
    const Tensor& t = operands[i];
    detail::check_floating("einsum", t);
    detail::check_compatible("einsum", operands[0], t);
    const std::string& letters = inputs[i];
    ZG_CHECK(static_cast<int64_t>(letters.size()) == t.dim(), "einsum: operand ", i, " ", describe(t), " has ", t.dim(),
             " dims but \"", letters, "\" names ", letters.size());
    for (size_t d = 0; d < letters.size(); ++d) {
      const char c = letters[d];
      ZG_CHECK(std::isalpha(static_cast<unsigned char>(c)), "einsum: \"", equation, "\": '", c,
               "' is not an index (letters a-z, A-Z)");
      ZG_CHECK(letters.find(c) == d, "einsum: \"", equation, "\": index '", c, "' is repeated in operand ", i,
               "; traces and diagonals are not supported");
      const int64_t size = t.size(static_cast<int64_t>(d));
      ZG_CHECK(!sizes.count(c) || sizes[c] == size, "einsum: \"", equation, "\": index '", c, "' has size ", sizes[c],
               " in one operand and ", size, " in operand ", i, " ", describe(t));
      sizes[c] = size;
      ++uses[c];
    }
  }
  std::string output;
  if (arrow == std::string::npos) {  // the letters used once, alphabetically
    for (const auto& [c, n] : uses)
      if (n == 1) output += c;
  } else {
    output = spec.substr(arrow + 2);
    for (size_t d = 0; d < output.size(); ++d)
      ZG_CHECK(sizes.count(output[d]) && output.find(output[d]) == d, "einsum: \"", equation, "\": output index '",
               output[d], "' ", sizes.count(output[d]) ? "is repeated" : "names no input dim");
  }
  Term result{operands[0], inputs[0]};
  for (size_t i = 1; i < operands.size(); ++i) {
    std::string later = output;
    for (size_t j = i + 1; j < inputs.size(); ++j) later += inputs[j];
    result = contract(result, {operands[i], inputs[i]}, later);
  }
  return arranged(sum_out(result, output), output);
}

}  // namespace zg
