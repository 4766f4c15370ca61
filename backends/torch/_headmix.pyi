# The C kernel's signature (backends/torch/_headmix.c): pointers are Tensor.data_ptr() values.
ABI: int

def map(
    is_double: bool,
    T: int,
    E: int,
    S: int,
    d: int,
    x: int,
    x_stride: int,
    W: int,
    b: int,
    g: int,
    y: int,
    y_stride: int,
    blocks: int,
    out: int,
    out_stride: int,
    eps: float,
    head_stride: int,
    block_stride: int,
    /,
) -> None: ...
