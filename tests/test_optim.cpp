#include "tiny_gpt.h"
