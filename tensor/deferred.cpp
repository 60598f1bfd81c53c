#include "tensor/deferred.h"
#include "tensor/init_recipe.h"

#include "tensor/cpu/loops.h"

namespace zg {

namespace {

thread_local bool deferring = false;

const InitRecipe& recipe_of(const Tensor& t) { return *t.storage()->recipe(); }

// The recipe of the values from element `elements` on.
InitRecipe advanced(InitRecipe recipe, int64_t elements) {
  if (recipe.cut.parts > 1) {  // a slice: further along its positions
    recipe.slice_start += elements;
    return recipe;
  }
  const uint64_t lane = recipe.random.first_lane + static_cast<uint64_t>(elements);
  recipe.random.first_block += lane / 4;
  recipe.random.first_lane = static_cast<uint32_t>(lane % 4);
  return recipe;
}

// v as an element of `dtype` holds it (rounded or saturated as a cast does), in f64.
double stored_as(DType dtype, double v) {
  return dispatch(dtype, [&]<class T>() { return cpu::convert<double>(cpu::convert<T>(v)); });
}

void check_deferred(const char* op, const Tensor& t) {
  ZG_CHECK(is_deferred(t), op, ": expected a deferred tensor, got ",
           t.defined() ? describe(t) + ", which has its values already" : "an undefined tensor");
  ZG_CHECK(t.is_contiguous(), op, ": the deferred ", describe(t),
           " is a view that is not contiguous; materialise the tensor it views");
}

// `out` (contiguous) gets the values `recipe` makes, in the tensor's dtype `own`.
void fill_from(const InitRecipe& recipe, DType own, const Tensor& out) {
  switch (recipe.kind) {
    case InitRecipe::Kind::undefined:
      return;  // empty(): any contents will do
    case InitRecipe::Kind::constant:
      backend(out.device()).fill(out, stored_as(own, stored_as(recipe.dtype, recipe.value)));
      return;
    case InitRecipe::Kind::random: {
      if (recipe.dtype == own && own == out.dtype()) {
        backend(out.device()).fill_random(out, recipe.random);
        return;
      }
      // Drawn in the factory's dtype and rounded to each later one, as the eager op and its conversions would.
      MemoryScope scope(MemoryCategory::workspace);
      const Tensor drawn = Tensor::empty(out.shape(), TensorOptions(recipe.dtype).device(out.device()));
      backend(out.device()).fill_random(drawn, recipe.random);
      Tensor(out).copy_(drawn.to(own));  // a handle: writes out
      return;
    }
  }
}

}  // namespace

DeferredInit::DeferredInit() : previous_(deferring) { deferring = true; }
DeferredInit::~DeferredInit() { deferring = previous_; }
bool DeferredInit::is_active() { return deferring; }

bool is_deferred(const Tensor& t) { return t.defined() && t.storage()->recipe() != nullptr; }

void check_materialized(const char* op, const Tensor& t) {
  ZG_CHECK(!is_deferred(t), op, ": ", describe(t), " is deferred (made under DeferredInit) and has no values yet; "
           "materialise it first (zg::materialize, materialize_range, or nn::materialize for a model)");
}

void materialize_range(const Tensor& deferred, int64_t begin, const Tensor& out) {
  const char* op = "materialize_range";
  check_deferred(op, deferred);
  ZG_CHECK(out.defined() && !is_deferred(out), op, ": the output must hold values, got ",
           out.defined() ? "the deferred " + describe(out) : "an undefined tensor");
  ZG_CHECK(out.is_contiguous(), op, ": the output ", describe(out), " is not contiguous");
  const int64_t n = out.numel();
  ZG_CHECK(begin >= 0 && begin <= deferred.numel() && n <= deferred.numel() - begin, op, ": the ", n,
           " elements from element ", begin, " are out of range for ", describe(deferred), " (", deferred.numel(),
           " elements)");
  const DType own = deferred.dtype();
  ZG_CHECK(out.dtype() == own || (is_floating(own) && is_floating(out.dtype())), op, ": cannot write the values of ",
           describe(deferred), " into ", describe(out), " (its dtype, or for a floating tensor any floating dtype)");
  begin_inplace(out, op);
  if (n == 0) return;
  const InitRecipe recipe = advanced(recipe_of(deferred), deferred.offset() + begin);
  if (recipe.cut.parts == 1) return fill_from(recipe, own, out);
  // A slice: each run of whole elements from its own place in the whole tensor's recipe.
  InitRecipe whole = recipe;
  whole.cut = {};
  const Tensor flat = out.reshape({n});
  // The meta device computes no values: its first two runs (a partial one, then a whole one)
  // show what filling costs -- the workspace of the longest -- and the rest repeat it. A
  // row-parallel cut of a [C, C] matrix is C runs, which would otherwise dominate a dry run.
  const int64_t runs = out.device().type == DeviceType::meta ? 2 : n;
  for (int64_t done = 0, k = 0; done < n && k < runs; ++k) {
    int64_t run = 0;
    const int64_t element = recipe.cut.element(recipe.slice_start + done, run);
    const int64_t length = std::min(run, n - done);
    fill_from(advanced(whole, element), own, flat.narrow(0, done, length));
    done += length;
  }
}

Tensor deferred_slice(const Tensor& deferred, int64_t dim, int64_t chunks, int parts, int part) {
  const char* op = "deferred_slice";
  check_deferred(op, deferred);
  const InitRecipe& recipe = recipe_of(deferred);
  ZG_CHECK(recipe.cut.parts == 1, op, ": ", describe(deferred), " is a slice already; cut the whole tensor");
  ZG_CHECK(dim >= 0 && dim < deferred.dim() && chunks >= 1 && parts >= 1 && part >= 0 && part < parts &&
               deferred.size(dim) % (chunks * parts) == 0,
           op, ": part ", part, " of ", parts, " along dim ", dim, " in ", chunks, " chunks does not fit ",
           describe(deferred));
  InitRecipe slice = advanced(recipe, deferred.offset());
  slice.cut = {.whole = deferred.shape(), .dim = dim, .chunks = chunks, .parts = parts};
  slice.slice_start = part * (deferred.numel() / parts);
  Shape shape = deferred.shape();
  shape[dim] /= parts;
  return deferred_tensor(shape, TensorOptions(deferred.dtype()).device(deferred.device()), slice);
}

Tensor materialize(const Tensor& deferred) {
  check_deferred("materialize", deferred);
  Tensor out = Tensor::empty(deferred.shape(), TensorOptions(deferred.dtype()).device(deferred.device()));
  materialize_range(deferred, 0, out);
  return out;
}

Tensor deferred_to(const Tensor& deferred, TensorOptions options) {
  check_deferred("to", deferred);
  const InitRecipe& recipe = recipe_of(deferred);
  ZG_CHECK(options.dtype() == deferred.dtype() || deferred.dtype() == recipe.dtype, "to: the deferred ",
           describe(deferred), " was made in ", name(recipe.dtype), " and converted once already; materialise it "
           "before converting it again (an eager tensor's values would be rounded twice)");
  return deferred_tensor(deferred.shape(), options, advanced(recipe, deferred.offset()));
}

}  // namespace zg
