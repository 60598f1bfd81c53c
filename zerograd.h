// zerograd: the public API in one include. The CUDA backend is reached through
// devices (kCUDA); its own installed headers (cuda/) are included by name.
#pragma once

#include "zerograd_config.h"  // ZG_HAVE_CUDA, ZG_HAVE_MPI

#include "tensor/activation.h"
#include "tensor/context.h"
#include "tensor/deferred.h"
#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/half.h"
#include "tensor/memory.h"
#include "tensor/memory_figure.h"
#include "tensor/memory_timeline.h"
#include "tensor/safetensors.h"
#include "tensor/shape.h"
#include "tensor/step_log.h"
#include "tensor/storage.h"
#include "tensor/tensor.h"
#include "tensor/trace.h"

#include "autograd/custom_op.h"
#include "autograd/functions.h"
#include "autograd/gradcheck.h"
#include "autograd/graph.h"
#include "autograd/split_backward.h"

#include "nn/causal_lm.h"
#include "nn/checkpoint.h"
#include "nn/generate.h"
#include "nn/gpt.h"
#include "nn/hf_gpt2.h"
#include "nn/init.h"
#include "nn/kv_cache.h"
#include "nn/layers.h"
#include "nn/llama.h"
#include "nn/module.h"
#include "nn/serialize.h"
#include "nn/parallel_plan.h"
#include "nn/unit_plan.h"

#include "optim/adamw.h"
#include "optim/grad_scaler.h"
#include "optim/schedule.h"

#include "dist/comm/agreement.h"
#include "dist/comm/device_mesh.h"
#include "dist/comm/differentiable.h"
#include "dist/comm/fake_group.h"
#include "dist/comm/launch.h"
#include "dist/comm/local_group.h"
#include "dist/comm/process_group.h"
#include "dist/comm/step_figure.h"
#include "dist/comm/step_model.h"
#if ZG_HAVE_MPI
#include "dist/comm/mpi_group.h"
#endif
#if ZG_HAVE_CUDA
#include "dist/comm/nccl_group.h"
#endif
#include "dist/zero/placement.h"
#include "dist/zero/sharded_model.h"
#include "dist/zero/writer_lock.h"
#include "dist/zero/zero_config.h"
#include "dist/tensor/parallel_linear.h"
#include "dist/tensor/parallelize.h"
#include "dist/tensor/sequence_parallel.h"
#include "dist/tensor/vocab_parallel.h"
#include "dist/pipeline/pipeline.h"
#include "dist/pipeline/schedule.h"
#include "dist/pipeline/schedule_figure.h"
#include "dist/pipeline/stages.h"
