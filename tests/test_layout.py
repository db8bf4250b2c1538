"""PagedLayout presets, the generic constructors and the staging format arithmetic."""

from __future__ import annotations

import pytest
import torch

import kvkernels
from kvkernels import PagedLayout, StagingFormat
from kvkernels.models import LAYOUTS, make_cache

L, B, N, H, D = 3, 10, 4, 2, 64


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_presets_describe_shape_without_copy(name):
    lay = make_cache(name, num_layers=L, num_blocks=B, block_size=N, num_heads=H, head_dim=D)
    mla = name.startswith("mla")
    assert lay.num_layers == L
    assert lay.num_kv == (1 if mla else 2)
    assert (lay.num_blocks, lay.block_size, lay.num_heads, lay.head_dim) == (B, N, 1 if mla else H, D)
    assert lay.chunk_nbytes == N * (1 if mla else H) * D * 2
    for row in lay.views:
        for v in row:
            assert v.shape == (B, N, lay.num_heads, D)
            assert v.stride(3) == 1


def test_views_alias_the_cache_memory():
    caches = [torch.zeros(2, B, N, H, D) for _ in range(L)]
    lay = PagedLayout.from_vllm(caches)
    caches[1][1, 7, 2, 1, 5] = 42.0  # V of layer 1, block 7, token 2, head 1, dim 5
    assert lay.views[1][1][7, 2, 1, 5].item() == 42.0
    assert lay.views[1][1].data_ptr() == caches[1][1].data_ptr()


@pytest.mark.parametrize(
    "kv_layout, shape, index",
    [
        ("NHD", (2, B, N, H, D), lambda t, c, b, n, h: t[c, b, n, h]),
        ("HND", (2, B, H, N, D), lambda t, c, b, n, h: t[c, b, h, n]),
    ],
)
def test_vllm_element_mapping(kv_layout, shape, index):
    t = torch.randn(shape)
    lay = PagedLayout.from_vllm([t], kv_layout)
    for c, b, n, h in [(0, 3, 1, 0), (1, 9, 3, 1)]:
        assert torch.equal(lay.views[0][c][b, n, h], index(t, c, b, n, h))


@pytest.mark.parametrize("ctor, phys_shape, inv", [
    ("from_vllm", lambda: (2, B, H, N, D), (0, 1, 3, 2, 4)),
    ("from_flashinfer", lambda: (B, 2, H, N, D), (0, 1, 3, 2, 4)),
])
def test_vllms_own_hnd_tensors_are_described_as_nhd_and_refused_as_hnd(ctor, phys_shape, inv):
    """vLLM allocates HND memory and hands out the NHD-shaped permuted view (its model runner:
    ``raw.view(physical).permute(inverse)``). Passed as "NHD" the strides describe it exactly (the
    same staging bytes as the HND-shaped tensor passed as "HND"); passed as "HND" it is refused
    (it swapped block size and head count silently)."""
    phys = torch.randn(*phys_shape())
    vllm_view = phys.permute(*inv)  # logical [.., N, H, D], HND strides
    lay = getattr(PagedLayout, ctor)([vllm_view])
    assert (lay.block_size, lay.num_heads) == (N, H)
    ref = getattr(PagedLayout, ctor)([phys], "HND")
    ids = [3, 0, 7]
    assert torch.equal(kvkernels.gather(lay, ids, backend="torch"), kvkernels.gather(ref, ids, backend="torch"))
    with pytest.raises(ValueError, match="pass it with kv_layout='NHD'"):
        getattr(PagedLayout, ctor)([vllm_view], "HND")
    with pytest.raises(ValueError, match="pass it with kv_layout='NHD'"):
        getattr(PagedLayout, ctor)({"layer.0": vllm_view}, "hnd")
    one_head = torch.randn(*phys_shape()[:2], 1, N, D).permute(*inv)  # one KV head per rank (TP = heads)
    assert getattr(PagedLayout, ctor)([one_head]).block_size == N
    with pytest.raises(ValueError, match="pass it with kv_layout='NHD'"):
        getattr(PagedLayout, ctor)([one_head], "HND")


def test_flashinfer_and_packed_and_sglang_mapping():
    t = torch.randn(B, 2, H, N, D)
    lay = PagedLayout.from_flashinfer([t], "HND")
    assert torch.equal(lay.views[0][1][4, 2, 1], t[4, 1, 1, 2])
    p = torch.randn(B, H, N, 2 * D)
    lay = PagedLayout.from_vllm_packed([p])
    assert torch.equal(lay.views[0][0][4, 2, 1], p[4, 1, 2, :D])
    assert torch.equal(lay.views[0][1][4, 2, 1], p[4, 1, 2, D:])
    k, v = torch.randn(B * N, H, D), torch.randn(B * N, H, D)
    lay = PagedLayout.from_sglang([k], [v], N)
    assert torch.equal(lay.views[0][1][3, 2, 1], v[3 * N + 2, 1])


def test_packed_single_tensor_orders_agree():
    """The same logical cache stored in each physical order gives identical views."""
    logical = torch.randn(L, B, H, N, 2 * D)  # [L, B, H, N, C]
    ref = PagedLayout.from_vllm_packed([logical[l] for l in range(L)])
    for order in kvkernels.layout.VLLM_PACKED_ORDERS:
        phys = logical.permute(["LBHNC".index(x) for x in order]).contiguous()
        lay = PagedLayout.from_vllm_packed(phys, order=order)
        for l in range(L):
            for c in range(2):
                assert torch.equal(lay.views[l][c], ref.views[l][c]), order


def test_cross_layer_matches_per_layer():
    t = torch.randn(B, L, 2, N, H, D)
    lay = PagedLayout.from_cross_layer(t)
    assert torch.equal(lay.views[2][1][5], t[5, 2, 1])
    assert lay.byte_strides[0] == L * 2 * N * H * D * 4


# vLLM 0.18's stride orders (get_kv_cache_stride_order(include_num_layers_dimension=True)) over the
# logical cross-layer shape: FlashAttention (L, 2, B, N, H, D), FlashInfer (L, B, 2, N, H, D)
_VLLM_STRIDE_ORDERS = {("flash_attn", "NHD"): (2, 0, 1, 3, 4, 5), ("flash_attn", "HND"): (2, 4, 0, 1, 3, 5),
                       ("flashinfer", "NHD"): (1, 0, 2, 3, 4, 5), ("flashinfer", "HND"): (1, 2, 4, 0, 3, 5)}


@pytest.mark.parametrize("backend, kv_layout", sorted(_VLLM_STRIDE_ORDERS))
def test_vllm_cross_layer_orders_name_vllms_physical_tensor(backend, kv_layout):
    """The documented cross-layer order of each vLLM backend/layout describes the tensor vLLM hands
    the connector (the allocation in physical order): block b, layer l, K/V c, token t, head h is
    the logical element. (The docs once gave TensorRT-LLM's BLKHND for vLLM's HND: wrong bytes,
    or a refusal, depending on the sizes.)"""
    Lx, Bx, Nx, Hx, Dx = 3, 5, 4, 2, 8
    flash = backend == "flash_attn"
    logical = torch.randn((Lx, 2, Bx, Nx, Hx, Dx) if flash else (Lx, Bx, 2, Nx, Hx, Dx))
    phys = logical.permute(_VLLM_STRIDE_ORDERS[backend, kv_layout]).contiguous()
    order = kvkernels.layout.VLLM_CROSS_LAYER_ORDERS[backend, kv_layout]
    lay = PagedLayout.from_cross_layer(phys, order=order)
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_dim) == (Lx, Bx, Nx, Hx, Dx)
    for l in range(Lx):
        for c in range(2):
            want = logical[l, c] if flash else logical[l, :, c]
            assert torch.equal(lay.views[l][c], want), (l, c)
    if kv_layout == "HND":  # TensorRT-LLM's order on vLLM's HND tensor: never vLLM's elements
        try:
            wrong = PagedLayout.from_cross_layer(phys, order="BLKHND")
        except ValueError:
            return
        assert not torch.equal(wrong.views[1][0], logical[1, 0] if flash else logical[1, :, 0])


def test_mla_takes_vllms_four_dim_views():
    """vLLM 0.33 hands MLA caches as 4-D [B, 1, N, C] views (one head): from_mla squeezes the head
    (from_vllm_packed would take them as K|V halves and split the latent)."""
    four = [torch.randn(B, 1, N, 576) for _ in range(L)]
    lay = PagedLayout.from_mla(four)
    ref = PagedLayout.from_mla([t[:, 0] for t in four])
    assert lay.num_kv == 1 and (lay.block_size, lay.head_dim) == (N, 576)
    for l in range(L):
        assert torch.equal(lay.views[l][0], ref.views[l][0])
        assert lay.views[l][0].data_ptr() == four[l].data_ptr()  # a view, no copy
    with pytest.raises(ValueError, match=r"kv_caches\[0\].*\[num_blocks, 1, block_size, head_dim\]"):
        PagedLayout.from_mla([torch.randn(B, 2, N, 576)])


def test_sglang_hnd_pools_are_page_major():
    """SGLang's HND pools (SGLANG_USE_HND_KVCACHE=1) are [num_pages, H, page_size, D]: slot loc
    lives at [loc // page_size, :, loc % page_size, :]; block b is page b."""
    pages, ps = 6, 4
    k, v = torch.randn(pages, H, ps, D), torch.randn(pages, H, ps, D)
    lay = PagedLayout.from_sglang([k], [v], ps)
    assert (lay.num_blocks, lay.block_size, lay.num_heads, lay.head_dim) == (pages, ps, H, D)
    for loc in (0, 5, 13, pages * ps - 1):
        assert torch.equal(lay.views[0][0][loc // ps, loc % ps], k[loc // ps, :, loc % ps])
        assert torch.equal(lay.views[0][1][loc // ps, loc % ps], v[loc // ps, :, loc % ps])
    with pytest.raises(ValueError, match=r"k_buffers\[0\].*page_size=4"):
        PagedLayout.from_sglang([torch.randn(pages, H, 8, D)], [v], ps)


def test_strided_slice_of_larger_allocation():
    big = torch.randn(2, B + 4, N, H, D + 32)
    cache = big[:, 2 : B + 2, :, :, 16 : 16 + D]
    lay = PagedLayout.from_vllm([cache])
    assert lay.num_blocks == B and not lay.is_contiguous_chunk()
    assert torch.equal(lay.views[0][0][0], big[0, 2, :, :, 16 : 16 + D])


def test_from_strides_generic_and_bounds():
    t = torch.randn(2 * B * N * H * D)
    lay = PagedLayout.from_strides(
        [t], block_size=N, num_heads=H, head_dim=D, strides=(N * H * D, H * D, D), kv_offset=B * N * H * D
    )
    assert lay.num_blocks == B
    assert torch.equal(lay.views[0][1], t[B * N * H * D :].view(B, N, H, D))
    with pytest.raises(ValueError, match="tensors\\[0\\]"):
        PagedLayout.from_strides([t], num_blocks=B + 1, block_size=N, num_heads=H, head_dim=D, strides=(N * H * D, H * D, D), kv_offset=B * N * H * D)
    with pytest.raises(ValueError, match="strides"):
        PagedLayout.from_strides([t], block_size=N, num_heads=H, head_dim=D, strides=(1, 2))


@pytest.mark.parametrize(
    "make, match, exc",
    [
        (lambda: PagedLayout.from_vllm(torch.zeros(2, B, N, H, D)), "kv_caches", TypeError),
        (lambda: PagedLayout.from_vllm([]), "kv_caches", ValueError),
        (lambda: PagedLayout.from_vllm([torch.zeros(3, B, N, H, D)]), "K axis", ValueError),
        (lambda: PagedLayout.from_vllm([torch.zeros(2, B, N, H)]), "dims", ValueError),
        (lambda: PagedLayout.from_vllm([torch.zeros(2, B, N, H, D)], "XYZ"), "kv_layout", ValueError),
        (lambda: PagedLayout.from_vllm([torch.zeros(2, B, N, H, D), torch.zeros(2, B, N, H, D + 1)]), "shape", ValueError),
        (lambda: PagedLayout.from_vllm([torch.zeros(2, B, N, H, D), torch.zeros(2, B, N, H, D, dtype=torch.half)]), "dtype", TypeError),
        (lambda: PagedLayout.from_vllm([torch.zeros(2, B, N, H, D), torch.zeros(2, B, H, N, D).transpose(2, 3)]), "strides", ValueError),
        (lambda: PagedLayout.from_vllm([torch.zeros(2, B, N, H, D).transpose(-1, -2)]), "contiguous head dim", ValueError),
        (lambda: PagedLayout.from_vllm(["not a tensor"]), "kv_caches\\[0\\]", TypeError),
        (lambda: PagedLayout.from_vllm_packed([torch.zeros(B, H, N, 2 * D + 1)]), "even", ValueError),
        (lambda: PagedLayout.from_vllm_packed(torch.zeros(L, B, N, H, 2 * D), order="LLNHC"), "order", ValueError),
        (lambda: PagedLayout.from_sglang([torch.zeros(8, H, D)], [], 4), "v_buffers", ValueError),
        (lambda: PagedLayout.from_sglang([torch.zeros(8, H, D)], [torch.zeros(8, H, D)], 0), "page_size", ValueError),
        (lambda: PagedLayout.from_sglang([torch.zeros(2, H, D)], [torch.zeros(2, H, D)], 4), "page_size", ValueError),
        (lambda: PagedLayout.from_cross_layer(torch.zeros(B, 2, N, H, D), order="BKNHD"), "'L'", ValueError),
        (lambda: PagedLayout.from_tensor(torch.zeros(B, N, H), "BNH"), "'D'", ValueError),
        (lambda: PagedLayout.from_views([[torch.zeros(B, N, H, D)] * 3]), "1 \\(MLA\\) or 2", ValueError),
        (lambda: PagedLayout.from_views([5]), "views\\[0\\]`: expected a sequence", TypeError),
        (lambda: PagedLayout.from_views([[torch.zeros(B, N, H, D, dtype=torch.complex64)]]), "real dtype", TypeError),
        # a meta tensor has no bytes: a gather over it returned no data and no error
        (lambda: PagedLayout.from_vllm([torch.zeros(2, B, N, H, D, device="meta")]), "CPU or CUDA memory", ValueError),
    ],
)
def test_bad_layouts_raise_naming_the_argument(make, match, exc):
    with pytest.raises(exc, match=match):
        make()


def test_staging_format_worked_example():
    """The example of docs/layouts.md: llama3-8b shape, 3 blocks, layers (0, 5)."""
    fmt = StagingFormat(layers=(0, 5), num_blocks=3, block_size=16, num_heads=8, head_dim=128, element_size=2)
    assert fmt.chunk_nbytes == 32768
    assert fmt.entry_nbytes == 98304
    assert fmt.payload_nbytes == 196608
    assert fmt.region_nbytes == 196608  # already a multiple of 4096
    assert fmt.entry_offset(5, 1) == 196608 + 98304
    assert fmt.nbytes == 393216
    mla = StagingFormat(layers=(0, 1, 2), num_blocks=3, block_size=1, num_heads=1, head_dim=576, element_size=2, num_kv=1)
    assert mla.payload_nbytes == 3456 and mla.region_nbytes == 4096 and mla.region_offset(2) == 8192
    with pytest.raises(ValueError, match="layer"):
        fmt.region_offset(1)


def test_staging_nbytes_and_layers_normalisation():
    lay = make_cache("vllm-nhd", num_layers=L, num_blocks=B, block_size=N, num_heads=H, head_dim=D)
    assert kvkernels.staging_nbytes(lay, 5) == L * 12288  # payload 2*5*4*2*64*2 = 10240 B, rounded up to 4096s
    fmt = StagingFormat.for_layout(lay, 5, layers=[2, 0])
    assert fmt.layers == (0, 2)
    assert fmt.payload_nbytes == 2 * 5 * N * H * D * 2
    with pytest.raises(ValueError, match="layers"):
        StagingFormat.for_layout(lay, 5, layers=[0, 0])
    with pytest.raises(ValueError, match="layers"):
        StagingFormat.for_layout(lay, 5, layers=[L])
    with pytest.raises(TypeError, match="layers"):
        StagingFormat.for_layout(lay, 5, layers=["0"])


@pytest.mark.parametrize("layout,heads,block_size", [("mla", 1, 16), ("vllm-hnd", 1, 16), ("sglang", 8, 1)])
def test_size_one_dims_do_not_decide_the_access_width(layout, heads, block_size):
    # torch gives a size-1 dimension an arbitrary stride (MLA's single head: 2 bytes); it is never
    # stepped, so it is reported as 0 and the kernels keep 16-byte accesses (on the H100 the MLA
    # gather ran in 2-byte words: 31 % of the copy peak on the CUDA backend)
    from kvkernels.triton_ops import _paged

    lay = make_cache(layout, num_layers=2, num_blocks=8, block_size=block_size, num_heads=heads, head_dim=576,
                     dtype=torch.bfloat16)
    sizes = (lay.num_blocks, lay.block_size, lay.num_heads)
    assert all(s == 0 for n, s in zip(sizes, lay.byte_strides) if n == 1)
    out = torch.empty(StagingFormat.for_layout(lay, 4).nbytes, dtype=torch.uint8)
    assert lay.access_width(out.data_ptr()) == 16
    assert _paged.aligned16(8, lay, out.data_ptr())
    ids = torch.tensor([3, -1, 7, 0])
    ref = kvkernels.gather(lay, ids, backend="torch")
    if kvkernels.backends.triton_available(lay.device):  # the 16-byte path itself (interpreter on CPU)
        assert torch.equal(kvkernels.gather(lay, ids, backend="triton"), ref)
    dst = make_cache(layout, num_layers=2, num_blocks=8, block_size=block_size, num_heads=heads, head_dim=576,
                     dtype=torch.bfloat16, fill="zero")
    kvkernels.scatter(ref, dst, torch.tensor([1, -1, 2, 5]), backend="torch")
    assert torch.equal(kvkernels.gather(dst, [1, 2, 5], backend="torch"), kvkernels.gather(lay, [3, 7, 0], backend="torch"))


def test_access_width_covers_rows_strides_bases_and_extra_addresses():
    big = torch.zeros(2, 13, 4, 2, 88, dtype=torch.bfloat16)
    aligned = kvkernels.PagedLayout.from_vllm([big[:, 3:11, :, :, 8:72]])  # every base 16-byte aligned
    odd = kvkernels.PagedLayout.from_vllm([big[:, 3:11, :, :, 1:65]])  # 2-byte offset
    buf = torch.zeros(1 << 12, dtype=torch.uint8)
    p = buf.data_ptr() + (-buf.data_ptr()) % 16
    assert aligned.access_width() == 16 and aligned.access_width(p) == 16
    assert aligned.access_width(p + 8) == 8 and aligned.access_width(p + 4, p) == 4
    assert aligned.access_width(p, cap=8) == 8
    assert odd.access_width(p) == 2 and odd.access_width(p + 1) == 1
    assert aligned.access_width(p + 2) == 2  # computed once per layout, the extra address each call


def test_preset_errors_name_the_presets_own_arguments():
    with pytest.raises(ValueError, match=r"`kv_caches\[1\]`: expected shape .* like kv_caches\[0\]"):
        kvkernels.PagedLayout.from_vllm([torch.zeros(2, 4, 2, 1, 8), torch.zeros(2, 4, 3, 1, 8)])
    with pytest.raises(ValueError, match=r"`v_buffers\[0\]`: expected shape .* like k_buffers\[0\]"):
        kvkernels.PagedLayout.from_sglang([torch.zeros(16, 1, 8)], [torch.zeros(8, 1, 8)], 4)
    with pytest.raises(ValueError, match=r"`kv_cache`: expected at least one layer"):
        kvkernels.PagedLayout.from_tensor(torch.zeros(0, 2, 4, 2, 2, 8), "LKBNHD")
    a, b = torch.zeros(100), torch.zeros(100, dtype=torch.float64)
    geo = dict(block_size=2, num_heads=1, head_dim=4, strides=(8, 4, 0), num_blocks=2)
    with pytest.raises(TypeError, match=r"`tensors\[1\]`: expected dtype torch.float32"):
        kvkernels.PagedLayout.from_strides([a, b], **geo)
    with pytest.raises(ValueError, match=r"`tensors\[0\]`: expected a tensor that does not require grad"):
        kvkernels.PagedLayout.from_strides([torch.zeros(100, requires_grad=True)], **geo)
    with pytest.raises(ValueError, match=r"`kv_caches`: expected 5 dims"):  # one packed tensor
        kvkernels.PagedLayout.from_vllm_packed(torch.zeros(2, 3, 4, 5))


def test_staging_format_cache_keeps_the_checks():
    """StagingFormat.for_layout looks formats up in a per-layout cache (it is on every copy's
    path): a hit must equal a fresh build, and a cached count must not let a bool or a bad layer
    through."""
    lay = make_cache("vllm-nhd", num_layers=4, num_blocks=8, block_size=4, num_heads=2, head_dim=64)
    a = StagingFormat.for_layout(lay, 3, (1, 2))
    assert StagingFormat.for_layout(lay, 3, (1, 2)) is a
    assert StagingFormat.for_layout(lay, 3, [2, 1]) == a  # lists are normalised, not cached
    assert StagingFormat.for_layout(lay, 1) == StagingFormat(tuple(range(4)), 1, 4, 2, 64, lay.element_size)
    with pytest.raises(TypeError):
        StagingFormat.for_layout(lay, True)
    with pytest.raises(ValueError, match="layers"):
        StagingFormat.for_layout(lay, 3, (5,))
    with pytest.raises(ValueError, match="layers"):
        StagingFormat.for_layout(lay, 3, (1, 1))
    with pytest.raises(ValueError):
        StagingFormat.for_layout(lay, -1)


def test_direct_constructor_gets_the_presets_checks():
    # PagedLayout(views=...) skipped every check of from_views: K of 8 blocks with V of 2 was
    # accepted and a Triton scatter to block 3 wrote past V's memory
    k, v = torch.zeros(8, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"views\[0\]\[1\].*shape"):
        PagedLayout(views=((k, v),))
    with pytest.raises(ValueError, match="memory of its own"):
        PagedLayout(views=((k, k),))
    with pytest.raises(TypeError, match="dtype"):
        PagedLayout(views=((k, k.clone().half()),))
    lay = PagedLayout(views=[[k, k.clone()]], kind="direct")  # normalised like from_views
    assert isinstance(lay.views, tuple) and all(isinstance(r, tuple) for r in lay.views)
    assert (lay.num_layers, lay.num_kv, lay.num_blocks, lay.kind) == (1, 2, 8, "direct")


def test_a_cache_that_requires_grad_is_refused():
    # the Triton kernels wrote it behind autograd's back; torch's fp8 scatter raised part way
    # through, after layer 0 was written
    caches = [torch.zeros(2, 8, 4, 2, 8) for _ in range(2)]
    caches[1].requires_grad_(True)
    with pytest.raises(ValueError, match=r"does not require grad \(pass \.detach\(\)\)"):
        PagedLayout.from_vllm(caches)
    caches[1] = caches[1].detach()
    assert PagedLayout.from_vllm(caches).num_layers == 2


def test_a_cache_at_an_address_not_aligned_to_its_elements_is_refused():
    """Tensor.set_ at a byte offset gives a bf16 cache at an odd address: the raw kernels cope
    (1-byte words) but the FP8 and shuffle kernels load whole elements (a fault on a GPU)."""
    raw = torch.zeros(2 * 8 * 4 * 2 * 8 * 2 + 1, dtype=torch.uint8)
    odd = torch.empty(0, dtype=torch.bfloat16).set_(raw.untyped_storage()[1:], 0, (2, 8, 4, 2, 8))
    assert odd.data_ptr() % 2 == 1
    with pytest.raises(ValueError, match=r"views\[0\]\[0\]`: expected an address aligned to its 2-byte elements"):
        PagedLayout.from_views([[odd[0], odd[1]]])
    ok = raw[:-1].view(torch.bfloat16).view(2, 8, 4, 2, 8)
    assert PagedLayout.from_views([[ok[0], ok[1]]]).num_layers == 1

def test_from_strides_sizes_every_layer_from_the_smallest_storage_and_checks_offsets():
    # num_blocks was computed per layer: two storages of different sizes gave views of different
    # shapes and a confusing "shape ... like views[0][0]" error, though the docstring promised the
    # smallest storage's count
    st = (N * H * D, H * D, D)
    small, big = torch.randn(3 * N * H * D), torch.randn(5 * N * H * D)
    lay = PagedLayout.from_strides([big, small], block_size=N, num_heads=H, head_dim=D, strides=st)
    assert lay.num_blocks == 3 and torch.equal(lay.views[0][0], big[: 3 * N * H * D].view(3, N, H, D))
    kw = dict(block_size=N, num_heads=H, head_dim=D, strides=st)
    with pytest.raises(TypeError, match="`offset`: expected an int"):
        PagedLayout.from_strides([big], offset=1.5, **kw)
    with pytest.raises(TypeError, match="`kv_offset`: expected an int"):
        PagedLayout.from_strides([big], kv_offset="8", **kw)
    with pytest.raises(ValueError, match="strides"):
        PagedLayout.from_strides([big], block_size=N, num_heads=H, head_dim=D, strides=(N * H * D, H * D, True))
    with pytest.raises(ValueError, match="at least one block"):
        PagedLayout.from_strides([big, torch.randn(D)], **kw)
    with pytest.raises(ValueError, match=r"tensors\[0\]"):
        PagedLayout.from_strides([big], offset=-1, **kw)


def test_a_copied_or_unpickled_layout_copies_its_own_tensors():
    """The layout keeps raw addresses (pointer tables, launch plans) of its tensors: a deepcopy
    or a pickle round trip has new tensors and must not inherit them (the compiled backends read
    and wrote the original cache through the copy)."""
    import copy
    import pickle

    from kvtest import BACKENDS, DEVICE

    lay = make_cache("vllm-nhd", num_layers=2, num_blocks=8, block_size=4, num_heads=2, head_dim=64, device=DEVICE)
    for be in BACKENDS:
        kvkernels.gather(lay, [1, 2], backend=be)  # the memo filled
    for dup in (copy.deepcopy(lay), pickle.loads(pickle.dumps(lay))):
        dup.views[0][0].fill_(3)  # the copy differs from the original now
        ref = kvkernels.gather(dup, [1, 2], backend="torch")
        for be in BACKENDS:
            assert torch.equal(kvkernels.gather(dup, [1, 2], backend=be), ref), be
        staging = torch.zeros_like(ref)
        for be in BACKENDS:
            kvkernels.scatter(staging, dup, [5, 6], backend=be)
            assert bool((dup.views[0][0][5:7] == 0).all()) and not bool((lay.views[0][0][5:7] == 0).all()), be
            dup.views[0][0][5:7].fill_(1)
