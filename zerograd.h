// zerograd: the public API in one include.
#pragma once

#include "autograd/functions.h"
#include "tensor/context.h"
#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/memory.h"
#include "tensor/tensor.h"
