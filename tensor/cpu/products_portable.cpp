// The products for any CPU: the library's own compiler flags.
#define ZG_PRODUCTS_ISA portable
#include "tensor/cpu/products.inc"
