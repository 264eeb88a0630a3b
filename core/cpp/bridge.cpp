// Lockstep's autograd bridge: the pieces of libtorch's C++ autograd that tch does not expose
// (custom functions, gradient hooks, backward with explicit gradients, storage free/refill and,
// with LOCKSTEP_CUDA, the current CUDA stream).
//
// Rules every entry point follows (core/src/autograd/ffi.rs mirrors them):
// - No C++ exception ever leaves this file: each `lk_*` function returns 0 on success and 1 on
//   failure, filling `lk_status` with either a Rust error payload (an error raised by a Rust
//   callback, handed back untouched) or a malloc'd message (any other exception).
// - Rust callbacks never unwind: they return 0/1 and, on failure, an owned error payload with
//   its drop function. We turn that into a `RustError` exception so libtorch's engine carries
//   it to whoever called backward; the payload is owned by a shared box and dropped exactly once.
// - Tensors handed to Rust are fresh `new at::Tensor(..)` objects that Rust takes ownership of
//   (tch's `Tensor::from_ptr`; tch frees them with `delete`). Tensors coming from Rust are
//   borrowed and copied (shallow) here.
// - Rust state (closures) is owned by a `RustBox` from the moment an entry point receives it,
//   so it is dropped exactly once on every path, success or error.

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Version.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>

#ifdef LOCKSTEP_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

extern "C" {
typedef void (*lk_drop_fn)(void*);

// What a failed entry point reports. Exactly one field is set on failure.
typedef struct {
  char* message;     // malloc'd, freed with lk_free_string
  void* rust_error;  // a payload a Rust callback produced, owned by the caller again
} lk_status;

// What a failed Rust callback hands to C++: an owned payload and how to drop it, and the
// error's text (malloc'd; C++ frees it) for when libtorch rethrows the exception as its own.
typedef struct {
  void* payload;
  lk_drop_fn drop;
  char* message;
} lk_err;

typedef int (*lk_backward_fn)(void* state, at::Tensor** saved, size_t n_saved,
                              at::Tensor** grads, size_t n_grads,
                              const uint8_t* needs_input_grad, size_t n_inputs,
                              void* out_vec, lk_err* err);
typedef int (*lk_hook_fn)(void* state, at::Tensor* grad, void* out_vec, lk_err* err);
typedef int (*lk_post_acc_fn)(void* state, at::Tensor* tensor, lk_err* err);
}

namespace {

// Owns one piece of Rust state and drops it through Rust exactly once.
struct RustBox {
  void* data;
  lk_drop_fn drop;
  RustBox(void* d, lk_drop_fn f) : data(d), drop(f) {}
  RustBox(const RustBox&) = delete;
  RustBox& operator=(const RustBox&) = delete;
  void* take() {
    void* d = data;
    data = nullptr;
    return d;
  }
  ~RustBox() {
    if (data != nullptr && drop != nullptr) {
      drop(data);  // the Rust side catches panics in drop functions
    }
  }
};

// An error raised by a Rust callback, travelling through libtorch as a C++ exception. Where
// the exception comes back through the bridge, the payload (the typed Rust error) does; where
// libtorch's engine rethrows it as its own error, `what()` keeps the cause in words.
struct RustError : public std::exception {
  std::shared_ptr<RustBox> payload;
  std::string text;
  explicit RustError(lk_err err)
      : payload(std::make_shared<RustBox>(err.payload, err.drop)),
        text(std::string("error raised by a Lockstep Rust callback: ") +
             (err.message != nullptr ? err.message : "(no message)")) {
    std::free(err.message);
  }
  const char* what() const noexcept override { return text.c_str(); }
};

[[noreturn]] void throw_rust(lk_err err) {
  if (err.payload == nullptr) {
    std::free(err.message);
    throw std::runtime_error("a Lockstep Rust callback failed without an error payload");
  }
  throw RustError(err);
}

char* dup_message(const char* msg) {
  size_t n = std::strlen(msg);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) {
    std::memcpy(out, msg, n + 1);
  }
  return out;
}

at::Tensor* to_rust(const at::Tensor& t) { return new at::Tensor(t); }

at::Tensor borrowed(const at::Tensor* t) { return t == nullptr ? at::Tensor() : *t; }

std::vector<at::Tensor> borrowed_list(const at::Tensor* const* ts, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(borrowed(ts[i]));
  }
  return out;
}

}  // namespace

#define LK_TRY try {
#define LK_CATCH(st)                                     \
  return 0;                                              \
  }                                                      \
  catch (RustError & e) {                                \
    (st)->rust_error = e.payload->take();                \
    if ((st)->rust_error == nullptr) {                   \
      (st)->message = dup_message("Rust error already taken"); \
    }                                                    \
    return 1;                                            \
  }                                                      \
  catch (const c10::Error& e) {                          \
    (st)->message = dup_message(e.what_without_backtrace()); \
    return 1;                                            \
  }                                                      \
  catch (const std::exception& e) {                      \
    (st)->message = dup_message(e.what());               \
    return 1;                                            \
  }                                                      \
  catch (...) {                                          \
    (st)->message = dup_message("unknown C++ exception"); \
    return 1;                                            \
  }

// ---------------------------------------------------------------------------------------------
// Custom functions
// ---------------------------------------------------------------------------------------------

namespace {

// The backward closure and its bookkeeping, stored in the node's `saved_data` as a capsule so
// it dies with the node whether or not backward ever runs.
struct FunctionState : torch::CustomClassHolder {
  RustBox state;
  lk_backward_fn backward;
  size_t n_inputs;
  FunctionState(void* s, lk_drop_fn drop, lk_backward_fn b, size_t n)
      : state(s, drop), backward(b), n_inputs(n) {}
};

// Everything `forward` needs; the outputs were computed by Rust before `apply`.
struct ForwardPayload {
  c10::intrusive_ptr<FunctionState> state;
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> saved;
  std::vector<size_t> non_differentiable;
  bool materialize_grads;
};

const char* const kStateKey = "lockstep_state";

struct LockstepFunction : public torch::autograd::Function<LockstepFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs, int64_t payload_addr) {
    (void)inputs;
    auto* payload = reinterpret_cast<ForwardPayload*>(static_cast<intptr_t>(payload_addr));
    ctx->saved_data[kStateKey] = c10::IValue::make_capsule(payload->state);
    ctx->set_materialize_grads(payload->materialize_grads);
    if (!payload->saved.empty()) {
      ctx->save_for_backward(payload->saved);
    }
    if (!payload->non_differentiable.empty()) {
      torch::autograd::variable_list nd;
      for (size_t i : payload->non_differentiable) {
        nd.push_back(payload->outputs.at(i));
      }
      ctx->mark_non_differentiable(nd);
    }
    return payload->outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto it = ctx->saved_data.find(kStateKey);
    TORCH_CHECK(it != ctx->saved_data.end(), "Lockstep function state is missing");
    auto holder = it->second.toCapsule();
    auto* st = static_cast<FunctionState*>(holder.get());
    TORCH_CHECK(st->state.data != nullptr, "Lockstep function state was already dropped");
    auto saved = ctx->get_saved_variables();

    std::vector<uint8_t> needs(st->n_inputs);
    for (size_t i = 0; i < st->n_inputs; ++i) {
      needs[i] = ctx->needs_input_grad(i) ? 1 : 0;
    }
    // Ownership of every pointer below passes to Rust, which takes them all before anything
    // that can fail.
    std::vector<at::Tensor*> saved_ptrs;
    saved_ptrs.reserve(saved.size());
    for (auto& s : saved) {
      saved_ptrs.push_back(to_rust(s));
    }
    std::vector<at::Tensor*> grad_ptrs;
    grad_ptrs.reserve(grads.size());
    for (auto& g : grads) {
      grad_ptrs.push_back(g.defined() ? to_rust(g) : nullptr);
    }
    torch::autograd::variable_list out;
    lk_err err{nullptr, nullptr, nullptr};
    int rc = st->backward(st->state.data, saved_ptrs.data(), saved_ptrs.size(),
                          grad_ptrs.data(), grad_ptrs.size(), needs.data(), needs.size(),
                          &out, &err);
    if (rc != 0) {
      throw_rust(err);
    }
    TORCH_CHECK(out.size() == st->n_inputs, "Lockstep backward returned ", out.size(),
                " gradients for ", st->n_inputs, " inputs");
    out.emplace_back();  // the payload argument's (undefined) gradient
    return out;
  }
};

}  // namespace

extern "C" {

void lk_free_string(char* s) { std::free(s); }

// The CPU capability ATen's kernels dispatch to ("AVX512", "AVX2", "DEFAULT", ...), what
// torch.backends.cpu.get_cpu_capability() returns (ATEN_CPU_CAPABILITY honoured). `*out`
// receives a malloc'd string, freed with lk_free_string.
int lk_cpu_capability(char** out, lk_status* st) {
  LK_TRY
  *out = dup_message(at::get_cpu_capability().c_str());
  TORCH_CHECK(*out != nullptr, "out of memory copying the CPU capability");
  LK_CATCH(st)
}

// The switches of at::globalContext() that decide whether a CUDA run repeats bit for bit and
// which arithmetic its matrix products use. Mirrors `Numerics` in core/src/machine.rs.
typedef struct {
  int deterministic_algorithms;  // alerts on ops without a deterministic kernel
  int deterministic_cudnn;
  int benchmark_cudnn;           // autotuning picks kernels by timing: off for repeatability
  int tf32_cublas;               // TF32 matrix products (10-bit mantissa inputs)
  int tf32_cudnn;
} lk_numerics;

int lk_set_numerics(const lk_numerics* want, lk_status* st) {
  LK_TRY
  auto& ctx = at::globalContext();
  ctx.setDeterministicAlgorithms(want->deterministic_algorithms != 0, /*warn_only=*/false);
  ctx.setDeterministicCuDNN(want->deterministic_cudnn != 0);
  ctx.setBenchmarkCuDNN(want->benchmark_cudnn != 0);
  ctx.setAllowTF32CuBLAS(want->tf32_cublas != 0);
  ctx.setAllowTF32CuDNN(want->tf32_cudnn != 0);
  LK_CATCH(st)
}

int lk_get_numerics(lk_numerics* out, lk_status* st) {
  LK_TRY
  auto& ctx = at::globalContext();
  out->deterministic_algorithms = ctx.deterministicAlgorithms() ? 1 : 0;
  out->deterministic_cudnn = ctx.deterministicCuDNN() ? 1 : 0;
  out->benchmark_cudnn = ctx.benchmarkCuDNN() ? 1 : 0;
  out->tf32_cublas = ctx.allowTF32CuBLAS() ? 1 : 0;
  out->tf32_cudnn = ctx.allowTF32CuDNN() ? 1 : 0;
  LK_CATCH(st)
}

// The CUDA runtime and cuDNN versions libtorch was built with and loads (0 when it has no CUDA),
// read through ATen's CUDA hooks so no CUDA header is needed.
int lk_cuda_versions(long* cudart, long* cudnn, lk_status* st) {
  LK_TRY
  const auto& hooks = at::detail::getCUDAHooks();
  *cudart = hooks.hasCUDART() ? hooks.versionCUDART() : 0;
  *cudnn = hooks.hasCuDNN() ? hooks.versionRuntimeCuDNN() : 0;
  LK_CATCH(st)
}

// Appends a (shallow) copy of `t` to a `variable_list` owned by C++; null means undefined.
int lk_vec_push(void* vec, const at::Tensor* t, lk_status* st) {
  LK_TRY
  static_cast<torch::autograd::variable_list*>(vec)->push_back(borrowed(t));
  LK_CATCH(st)
}

// Attaches a graph node to `outputs` (computed by Rust under no-grad) whose backward calls
// `backward(state, ..)`. Takes ownership of `state` on every path. `results` receives one
// owned tensor per output.
int lk_function_apply(const at::Tensor* const* inputs, size_t n_inputs,
                      const at::Tensor* const* outputs, size_t n_outputs,
                      const at::Tensor* const* saved, size_t n_saved,
                      const size_t* non_differentiable, size_t n_non_differentiable,
                      int materialize_grads, void* state, lk_backward_fn backward,
                      lk_drop_fn drop, at::Tensor** results, lk_status* st) {
  c10::intrusive_ptr<FunctionState> holder;
  LK_TRY
  holder = c10::make_intrusive<FunctionState>(state, drop, backward, n_inputs);
  ForwardPayload payload;
  payload.state = holder;
  payload.outputs = borrowed_list(outputs, n_outputs);
  payload.saved = borrowed_list(saved, n_saved);
  payload.non_differentiable.assign(non_differentiable,
                                    non_differentiable + n_non_differentiable);
  payload.materialize_grads = materialize_grads != 0;
  for (size_t i : payload.non_differentiable) {
    TORCH_CHECK(i < n_outputs, "non-differentiable output index ", i, " out of range");
  }
  holder.reset();  // the payload (then the node) is the only owner from here on
  auto ins = borrowed_list(inputs, n_inputs);
  auto outs = LockstepFunction::apply(at::TensorList(ins),
                                      static_cast<int64_t>(reinterpret_cast<intptr_t>(&payload)));
  TORCH_CHECK(outs.size() == n_outputs, "Lockstep function produced ", outs.size(),
              " outputs, expected ", n_outputs);
  for (size_t i = 0; i < n_outputs; ++i) {
    results[i] = to_rust(outs[i]);
  }
  LK_CATCH(st)
}

// ---------------------------------------------------------------------------------------------
// Backward and grad with explicit output gradients
// ---------------------------------------------------------------------------------------------

// `retain_graph` < 0 means "as create_graph" (libtorch's default).
int lk_backward(const at::Tensor* const* outputs, size_t n_outputs,
                const at::Tensor* const* grad_outputs, int retain_graph, int create_graph,
                lk_status* st) {
  LK_TRY
  auto outs = borrowed_list(outputs, n_outputs);
  auto grads = borrowed_list(grad_outputs, n_outputs);
  std::optional<bool> keep;
  if (retain_graph >= 0) {
    keep = retain_graph != 0;
  }
  torch::autograd::backward(outs, grads, keep, create_graph != 0);
  LK_CATCH(st)
}

int lk_grad(const at::Tensor* const* outputs, size_t n_outputs,
            const at::Tensor* const* grad_outputs, const at::Tensor* const* inputs,
            size_t n_inputs, int retain_graph, int create_graph, int allow_unused,
            at::Tensor** results, lk_status* st) {
  LK_TRY
  auto outs = borrowed_list(outputs, n_outputs);
  auto grads = borrowed_list(grad_outputs, n_outputs);
  auto ins = borrowed_list(inputs, n_inputs);
  std::optional<bool> keep;
  if (retain_graph >= 0) {
    keep = retain_graph != 0;
  }
  auto res = torch::autograd::grad(outs, ins, grads, keep, create_graph != 0, allow_unused != 0);
  TORCH_CHECK(res.size() == n_inputs, "grad returned ", res.size(), " results");
  for (size_t i = 0; i < n_inputs; ++i) {
    results[i] = res[i].defined() ? to_rust(res[i]) : nullptr;
  }
  LK_CATCH(st)
}

// Sets (or with null, clears) a tensor's `.grad`.
int lk_set_grad(const at::Tensor* t, const at::Tensor* grad, lk_status* st) {
  LK_TRY
  t->mutable_grad() = borrowed(grad);
  LK_CATCH(st)
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// Hooks
// ---------------------------------------------------------------------------------------------

namespace {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct HookState {
  RustBox state;
  lk_hook_fn hook;
  HookState(void* s, lk_drop_fn d, lk_hook_fn h) : state(s, d), hook(h) {}
};

struct PostAccState {
  RustBox state;
  lk_post_acc_fn hook;
  PostAccState(void* s, lk_drop_fn d, lk_post_acc_fn h) : state(s, d), hook(h) {}
};

// Our post-accumulate-grad hook slot: libtorch keeps one per leaf, so we keep a table in it.
struct PostAccTable : public torch::autograd::PostAccumulateGradHook {
  std::mutex mu;
  std::map<uint64_t, std::shared_ptr<PostAccState>> hooks;
  uint64_t next_id = 0;

  void operator()(const torch::autograd::Variable& tensor) override {
    std::vector<std::shared_ptr<PostAccState>> snapshot;
    {
      std::lock_guard<std::mutex> g(mu);
      for (auto& kv : hooks) {
        snapshot.push_back(kv.second);
      }
    }
    for (auto& h : snapshot) {
      lk_err err{nullptr, nullptr, nullptr};
      if (h->hook(h->state.data, to_rust(tensor), &err) != 0) {
        throw_rust(err);
      }
    }
  }
};

struct HookHandle {
  WeakImpl tensor;
  bool post_accumulate;
  uint64_t id;  // position in the tensor's hook list, or key in PostAccTable
};

std::optional<at::Tensor> upgrade(const WeakImpl& weak) {
  auto strong = weak.lock();
  if (!strong) {
    return std::nullopt;
  }
  return at::Tensor(std::move(strong));
}

}  // namespace

extern "C" {

// Registers a gradient hook on `t`; takes ownership of `state` on every path.
int lk_register_hook(const at::Tensor* t, void* state, lk_hook_fn hook, lk_drop_fn drop,
                     void** handle_out, lk_status* st) {
  auto hs = std::make_shared<HookState>(state, drop, hook);
  LK_TRY
  TORCH_CHECK(t != nullptr && t->defined(), "cannot register a hook on an undefined tensor");
  auto fn = [hs](const at::TensorBase& grad) -> at::TensorBase {
    torch::autograd::variable_list out;
    lk_err err{nullptr, nullptr, nullptr};
    at::Tensor* g = grad.defined() ? to_rust(at::Tensor(grad)) : nullptr;
    if (hs->hook(hs->state.data, g, &out, &err) != 0) {
      throw_rust(err);
    }
    if (out.empty()) {
      return at::TensorBase();
    }
    return out[0];
  };
  unsigned pos = static_cast<const at::TensorBase&>(*t).register_hook(std::move(fn));
  hs.reset();
  *handle_out = new HookHandle{WeakImpl(t->getIntrusivePtr()), false, pos};
  LK_CATCH(st)
}

// Registers a hook run after a leaf's gradient was accumulated for this backward.
int lk_register_post_accumulate_grad_hook(const at::Tensor* t, void* state, lk_post_acc_fn hook,
                                          lk_drop_fn drop, void** handle_out, lk_status* st) {
  auto hs = std::make_shared<PostAccState>(state, drop, hook);
  LK_TRY
  TORCH_CHECK(t != nullptr && t->defined(), "cannot register a hook on an undefined tensor");
  TORCH_CHECK(t->requires_grad(),
              "cannot register a post-accumulate-grad hook on a tensor that does not "
              "require grad");
  TORCH_CHECK(t->is_leaf(), "post-accumulate-grad hooks can only be registered on leaf tensors");
  auto& slot = torch::autograd::impl::post_acc_grad_hooks(*t);
  if (!slot) {
    torch::autograd::impl::set_post_acc_grad_hooks(*t, std::make_unique<PostAccTable>());
  }
  auto* table = dynamic_cast<PostAccTable*>(torch::autograd::impl::post_acc_grad_hooks(*t).get());
  TORCH_CHECK(table != nullptr,
              "this tensor already carries a post-accumulate-grad hook Lockstep does not own");
  uint64_t id;
  {
    std::lock_guard<std::mutex> g(table->mu);
    id = table->next_id++;
    table->hooks.emplace(id, std::move(hs));
  }
  *handle_out = new HookHandle{WeakImpl(t->getIntrusivePtr()), true, id};
  LK_CATCH(st)
}

// Removes the hook; `*removed` is 0 if the tensor (and so its hooks) is already gone.
int lk_hook_remove(void* handle, int* removed, lk_status* st) {
  LK_TRY
  auto* h = static_cast<HookHandle*>(handle);
  *removed = 0;
  auto t = upgrade(h->tensor);
  if (!t) {
    return 0;
  }
  if (h->post_accumulate) {
    auto* table =
        dynamic_cast<PostAccTable*>(torch::autograd::impl::post_acc_grad_hooks(*t).get());
    if (table != nullptr) {
      std::shared_ptr<PostAccState> victim;
      {
        std::lock_guard<std::mutex> g(table->mu);
        auto it = table->hooks.find(h->id);
        if (it != table->hooks.end()) {
          victim = std::move(it->second);
          table->hooks.erase(it);
          *removed = 1;
        }
      }
      // `victim` drops (outside the lock) here, unless a running backward still holds it.
    }
  } else {
    t->remove_hook(static_cast<unsigned>(h->id));
    *removed = 1;
  }
  LK_CATCH(st)
}

void lk_hook_handle_free(void* handle) { delete static_cast<HookHandle*>(handle); }

// ---------------------------------------------------------------------------------------------
// Storage free / refill
// ---------------------------------------------------------------------------------------------

// Releases the tensor's storage memory but keeps its recorded size, so every alias (views,
// saved tensors) sees "not allocated" (libtorch raises on data access) until refilled.
int lk_storage_free(const at::Tensor* t, size_t* released, lk_status* st) {
  LK_TRY
  TORCH_CHECK(t != nullptr && t->defined(), "cannot free an undefined tensor's storage");
  TORCH_CHECK(t->has_storage(), "tensor has no storage");
  auto* impl = t->storage().unsafeGetStorageImpl();
  *released = impl->data() != nullptr ? impl->nbytes() : 0;
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  LK_CATCH(st)
}

int lk_storage_info(const at::Tensor* t, size_t* nbytes, int* freed, lk_status* st) {
  LK_TRY
  TORCH_CHECK(t != nullptr && t->defined(), "undefined tensor");
  TORCH_CHECK(t->has_storage(), "tensor has no storage");
  auto* impl = t->storage().unsafeGetStorageImpl();
  *nbytes = impl->nbytes();
  *freed = (impl->data() == nullptr && impl->nbytes() > 0) ? 1 : 0;
  LK_CATCH(st)
}

// Re-allocates a freed storage at its recorded size (no-op if allocated), then copies `src`
// (if given) into `t` without bumping the version counter, so saved tensors stay valid.
int lk_storage_refill(const at::Tensor* t, const at::Tensor* src, lk_status* st) {
  LK_TRY
  TORCH_CHECK(t != nullptr && t->defined(), "cannot refill an undefined tensor's storage");
  TORCH_CHECK(t->has_storage(), "tensor has no storage");
  auto* impl = t->storage().unsafeGetStorageImpl();
  if (impl->data() == nullptr && impl->nbytes() > 0) {
    at::Allocator* alloc = impl->allocator();
    if (alloc == nullptr) {
      alloc = c10::GetAllocator(impl->device_type());
    }
    TORCH_CHECK(alloc != nullptr, "no allocator for ", impl->device());
    impl->set_data_ptr_noswap(alloc->allocate(impl->nbytes()));
  }
  if (src != nullptr && src->defined()) {
    // A copy shares the counter with the tensor (and its views and saved versions).
    c10::VariableVersion vc = t->unsafeGetTensorImpl()->version_counter();
    auto version = vc.current_version();
    {
      at::NoGradGuard no_grad;
      t->copy_(*src);
    }
    vc.set_version(version);
  }
  LK_CATCH(st)
}

int lk_tensor_version(const at::Tensor* t, int64_t* version, lk_status* st) {
  LK_TRY
  TORCH_CHECK(t != nullptr && t->defined(), "undefined tensor");
  *version = t->_version();
  LK_CATCH(st)
}

// ---------------------------------------------------------------------------------------------
// Scaled in-place arithmetic (PyTorch's optimizers)
// ---------------------------------------------------------------------------------------------

// The ops `torch.optim` steps with, with the scalar argument tch's generated API drops:
// `t.add_(other, alpha)`, `t.addcmul_(a, b, value)`, `t.addcdiv_(a, b, value)`. Running
// libtorch's own kernel is the only way to get its rounding (the CPU kernels fuse the
// multiply-add), which two separate ops cannot reproduce.
int lk_add_scaled_(const at::Tensor* t, const at::Tensor* other, double alpha, lk_status* st) {
  LK_TRY
  TORCH_CHECK(t != nullptr && t->defined() && other != nullptr && other->defined(),
              "add_: undefined tensor");
  at::Tensor self = *t;
  self.add_(*other, alpha);
  LK_CATCH(st)
}

int lk_addcmul_(const at::Tensor* t, const at::Tensor* a, const at::Tensor* b, double value,
                lk_status* st) {
  LK_TRY
  TORCH_CHECK(t != nullptr && t->defined() && a != nullptr && a->defined() && b != nullptr &&
                  b->defined(),
              "addcmul_: undefined tensor");
  at::Tensor self = *t;
  self.addcmul_(*a, *b, value);
  LK_CATCH(st)
}

int lk_addcdiv_(const at::Tensor* t, const at::Tensor* a, const at::Tensor* b, double value,
                lk_status* st) {
  LK_TRY
  TORCH_CHECK(t != nullptr && t->defined() && a != nullptr && a->defined() && b != nullptr &&
                  b->defined(),
              "addcdiv_: undefined tensor");
  at::Tensor self = *t;
  self.addcdiv_(*a, *b, value);
  LK_CATCH(st)
}

// ---------------------------------------------------------------------------------------------
// CUDA stream
// ---------------------------------------------------------------------------------------------

#ifdef LOCKSTEP_CUDA
int lk_current_cuda_stream(int64_t device, void** stream, lk_status* st) {
  LK_TRY
  auto s = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  *stream = static_cast<void*>(s.stream());
  LK_CATCH(st)
}
#endif

}  // extern "C"
