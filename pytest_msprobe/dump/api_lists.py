"""The APIs captured at level L1, one tuple of names per namespace.

Numeric operations only: metadata and query methods (``dim``, ``size``, ``numel``, ``stride``, ``is_*``,
``data_ptr``, ``item``, ``tolist``, ``__len__``, ``__repr__``, ``__bool__`` ...) are left out, and so are the
autograd plumbing methods (``backward``, ``register_hook``, ``detach``, ``requires_grad_`` ...), since wrapping
them would record calls that compute nothing.  A name that the installed torch does not have is skipped when the
wrappers are installed, so one list serves several torch versions.

The record prefix of each namespace is msprobe's, so names line up with its dumps: ``torch.nn.functional`` ->
``Functional``, ``torch`` -> ``Torch``, ``torch.Tensor`` -> ``Tensor``, ``torch._VF`` -> ``VF``,
``torch_npu`` -> ``NPU``, ``torch.distributed`` -> ``Distributed``.  Names in the torch list may be dotted
(``linalg.norm``): the function is looked up in the sub-namespace and recorded as ``Torch.linalg.norm``.
"""

from __future__ import annotations


def _names(text: str) -> tuple[str, ...]:
    return tuple(sorted(set(text.split())))


FUNCTIONAL: tuple[str, ...] = _names(
    """
    adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool1d_with_indices
    adaptive_max_pool2d adaptive_max_pool2d_with_indices adaptive_max_pool3d adaptive_max_pool3d_with_indices
    affine_grid alpha_dropout avg_pool1d avg_pool2d avg_pool3d batch_norm bilinear binary_cross_entropy
    binary_cross_entropy_with_logits celu celu_ channel_shuffle conv1d conv2d conv3d conv_tbc conv_transpose1d
    conv_transpose2d conv_transpose3d cosine_embedding_loss cosine_similarity cross_entropy ctc_loss dropout
    dropout1d dropout2d dropout3d elu elu_ embedding embedding_bag feature_alpha_dropout fold fractional_max_pool2d
    fractional_max_pool2d_with_indices fractional_max_pool3d fractional_max_pool3d_with_indices gaussian_nll_loss
    gelu glu grid_sample group_norm gumbel_softmax hardshrink hardsigmoid hardswish hardtanh hardtanh_
    hinge_embedding_loss huber_loss instance_norm interpolate kl_div l1_loss layer_norm leaky_relu leaky_relu_
    linear local_response_norm log_softmax logsigmoid lp_pool1d lp_pool2d lp_pool3d margin_ranking_loss
    max_pool1d max_pool1d_with_indices max_pool2d max_pool2d_with_indices max_pool3d max_pool3d_with_indices
    max_unpool1d max_unpool2d max_unpool3d mish mse_loss multi_head_attention_forward multi_margin_loss
    multilabel_margin_loss multilabel_soft_margin_loss nll_loss normalize one_hot pad pairwise_distance pdist
    pixel_shuffle pixel_unshuffle poisson_nll_loss prelu relu relu6 relu_ rms_norm rrelu rrelu_
    scaled_dot_product_attention selu selu_ sigmoid silu smooth_l1_loss soft_margin_loss softmax softmin softplus
    softshrink softsign tanh tanhshrink threshold threshold_ triplet_margin_loss triplet_margin_with_distance_loss
    unfold upsample upsample_bilinear upsample_nearest
    """
)

TENSOR: tuple[str, ...] = _names(
    """
    __abs__ __add__ __and__ __div__ __eq__ __floordiv__ __ge__ __getitem__ __gt__ __iadd__ __iand__ __idiv__
    __ifloordiv__ __ilshift__ __imod__ __imul__ __invert__ __ior__ __ipow__ __irshift__ __isub__ __itruediv__
    __ixor__ __le__ __lshift__ __lt__ __matmul__ __mod__ __mul__ __ne__ __neg__ __or__ __pos__ __pow__ __radd__
    __rand__ __rdiv__ __rfloordiv__ __rlshift__ __rmatmul__ __rmod__ __rmul__ __ror__ __rpow__ __rrshift__
    __rshift__ __rsub__ __rtruediv__ __rxor__ __setitem__ __sub__ __truediv__ __xor__
    abs abs_ absolute absolute_ acos acos_ acosh acosh_ add add_ addbmm addbmm_ addcdiv addcdiv_ addcmul addcmul_
    addmm addmm_ addmv addmv_ addr addr_ adjoint all allclose amax amin aminmax angle any arccos arccos_ arccosh
    arccosh_ arcsin arcsin_ arcsinh arcsinh_ arctan arctan2 arctan2_ arctan_ arctanh arctanh_ argmax argmin argsort
    argwhere as_strided asin asin_ asinh asinh_ atan atan2 atan2_ atan_ atanh atanh_ baddbmm baddbmm_ bernoulli
    bernoulli_ bfloat16 bincount bitwise_and bitwise_and_ bitwise_left_shift bitwise_left_shift_ bitwise_not
    bitwise_not_ bitwise_or bitwise_or_ bitwise_right_shift bitwise_right_shift_ bitwise_xor bitwise_xor_ bmm bool
    broadcast_to byte cauchy_ ceil ceil_ cfloat char cholesky cholesky_inverse cholesky_solve chunk clamp clamp_
    clamp_max clamp_max_ clamp_min clamp_min_ clip clip_ clone conj_physical contiguous copy_ copysign copysign_
    corrcoef cos cos_ cosh cosh_ count_nonzero cov cross cummax cummin cumprod cumprod_ cumsum cumsum_ deg2rad
    deg2rad_ det diag diag_embed diagflat diagonal diagonal_scatter diff digamma digamma_ dist div div_ divide
    divide_ dot double dsplit eq eq_ equal erf erf_ erfc erfc_ erfinv erfinv_ exp exp2 exp2_ exp_ expand expand_as
    expm1 expm1_ exponential_ fill_ fill_diagonal_ fix fix_ flatten flip fliplr flipud float float_power
    float_power_ floor floor_ floor_divide floor_divide_ fmax fmin fmod fmod_ frac frac_ frexp gather gcd gcd_ ge
    ge_ geometric_ geqrf ger greater greater_ greater_equal greater_equal_ gt gt_ half hardshrink heaviside
    heaviside_ histc histogram hsplit hypot hypot_ i0 i0_ igamma igamma_ igammac igammac_ index_add index_add_
    index_copy index_copy_ index_fill index_fill_ index_put index_put_ index_reduce index_reduce_ index_select
    inner int inverse isclose isfinite isinf isnan isneginf isposinf isreal kron kthvalue lcm lcm_ ldexp ldexp_ le
    le_ lerp lerp_ less less_ less_equal less_equal_ lgamma lgamma_ log log10 log10_ log1p log1p_ log2 log2_ log_
    log_normal_ log_softmax logaddexp logaddexp2 logcumsumexp logdet logical_and logical_and_ logical_not
    logical_not_ logical_or logical_or_ logical_xor logical_xor_ logit logit_ logsumexp long lu_solve masked_fill
    masked_fill_ masked_scatter masked_scatter_ masked_select matmul matrix_exp matrix_power max maximum mean
    median min minimum mm mode moveaxis movedim msort mul mul_ multinomial multiply multiply_ mv mvlgamma mvlgamma_
    nan_to_num nan_to_num_ nanmean nanmedian nanquantile nansum narrow narrow_copy ne ne_ neg neg_ negative
    negative_ new_empty new_full new_ones new_tensor new_zeros nextafter nextafter_ nonzero norm normal_ not_equal
    not_equal_ orgqr ormqr outer permute pinverse polygamma polygamma_ positive pow pow_ prelu prod put put_ qr
    quantile rad2deg rad2deg_ random_ ravel reciprocal reciprocal_ relu relu_ remainder remainder_ renorm renorm_
    repeat repeat_interleave reshape reshape_as resize_ resize_as_ resolve_conj resolve_neg roll rot90 round round_
    rsqrt rsqrt_ scatter scatter_ scatter_add scatter_add_ scatter_reduce scatter_reduce_ select select_scatter sgn
    sgn_ short sigmoid sigmoid_ sign sign_ signbit sin sin_ sinc sinc_ sinh sinh_ slice_scatter slogdet smm softmax
    sort split split_with_sizes sqrt sqrt_ square square_ squeeze squeeze_ sspaddmm std stft sub sub_ subtract
    subtract_ sum sum_to_size svd swapaxes swapaxes_ swapdims swapdims_ t t_ take take_along_dim tan tan_ tanh tanh_
    tensor_split tile to topk trace transpose transpose_ triangular_solve tril tril_ triu triu_ true_divide
    true_divide_ trunc trunc_ type_as unbind unflatten unfold uniform_ unique unique_consecutive unsafe_chunk
    unsafe_split unsafe_split_with_sizes unsqueeze unsqueeze_ var vdot view view_as vsplit where xlogy xlogy_ zero_
    """
)

TORCH: tuple[str, ...] = _names(
    """
    abs abs_ absolute acos acos_ acosh acosh_ adaptive_avg_pool1d adaptive_max_pool1d add addbmm addcdiv addcmul
    addmm addmv addmv_ addr adjoint affine_grid_generator all allclose alpha_dropout alpha_dropout_ amax amin
    aminmax angle any arange arccos arccos_ arccosh arccosh_ arcsin arcsin_ arcsinh arcsinh_ arctan arctan2 arctan_
    arctanh arctanh_ argmax argmin argsort argwhere as_strided asin asin_ asinh asinh_ atan atan2 atan_ atanh atanh_
    atleast_1d atleast_2d atleast_3d avg_pool1d baddbmm bartlett_window batch_norm batch_norm_backward_elemt
    batch_norm_backward_reduce batch_norm_elemt batch_norm_gather_stats batch_norm_gather_stats_with_counts
    batch_norm_stats batch_norm_update_stats bernoulli bilinear binary_cross_entropy_with_logits bincount binomial
    bitwise_and bitwise_left_shift bitwise_not bitwise_or bitwise_right_shift bitwise_xor blackman_window
    block_diag bmm broadcast_tensors broadcast_to bucketize cartesian_prod cat cdist ceil ceil_ celu celu_
    chain_matmul channel_shuffle cholesky_inverse cholesky_solve chunk clamp clamp_ clamp_max clamp_max_ clamp_min
    clamp_min_ clip clip_ clone column_stack combinations complex concat concatenate conj_physical constant_pad_nd
    conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution copysign corrcoef
    cos cos_ cosh cosh_ cosine_embedding_loss cosine_similarity count_nonzero cov cross ctc_loss cummax cummin
    cumprod cumsum cumulative_trapezoid deg2rad deg2rad_ det diag diag_embed diagflat diagonal diagonal_scatter diff
    digamma dist div divide dot dropout dropout_ dsmm dsplit dstack einsum embedding embedding_bag
    embedding_renorm_ empty_like eq equal erf erf_ erfc erfc_ erfinv exp exp2 exp2_ exp_ expm1 expm1_ eye
    feature_alpha_dropout feature_alpha_dropout_ feature_dropout feature_dropout_ fill fill_ fix fix_ flatten flip
    fliplr flipud float_power floor floor_ floor_divide fmax fmin fmod frac frac_ frexp frobenius_norm full
    full_like gather gcd gcd_ ge geqrf ger greater greater_equal grid_sampler grid_sampler_2d grid_sampler_3d
    group_norm gru gru_cell gt hamming_window hann_window hardshrink heaviside hinge_embedding_loss histc histogram
    histogramdd hsmm hsplit hspmm hstack hypot i0 i0_ igamma igammac index_add index_copy index_fill index_put
    index_put_ index_reduce index_select inner instance_norm inverse isclose isfinite isin isinf isnan isneginf
    isposinf isreal istft kaiser_window kl_div kron kthvalue layer_norm lcm lcm_ ldexp ldexp_ le lerp less
    less_equal lgamma linspace log log10 log10_ log1p log1p_ log2 log2_ log_ log_softmax logaddexp logaddexp2
    logcumsumexp logdet logical_and logical_not logical_or logical_xor logit logit_ logspace logsumexp lstm
    lstm_cell lt lu lu_solve lu_unpack margin_ranking_loss masked_fill masked_scatter masked_select matmul
    matrix_exp matrix_power max max_pool1d max_pool1d_with_indices max_pool2d max_pool3d maximum mean median
    meshgrid min minimum mm mode moveaxis movedim msort mul multinomial multiply mv mvlgamma nan_to_num nan_to_num_
    nanmean nanmedian nanquantile nansum narrow narrow_copy native_batch_norm native_channel_shuffle native_dropout
    native_group_norm native_layer_norm native_norm ne neg neg_ negative negative_ nextafter nonzero norm
    norm_except_dim normal not_equal nuclear_norm ones ones_like outer pairwise_distance pdist permute pinverse
    pixel_shuffle pixel_unshuffle poisson poisson_nll_loss polar polygamma positive pow prelu prod put quantile
    rad2deg rad2deg_ rand rand_like randint randint_like randn randn_like randperm range ravel real reciprocal
    reciprocal_ relu relu_ remainder renorm repeat_interleave reshape resize_as_ resolve_conj resolve_neg rms_norm
    rnn_relu rnn_relu_cell rnn_tanh rnn_tanh_cell roll rot90 round round_ row_stack rrelu rrelu_ rsqrt rsqrt_ rsub
    saddmm scalar_tensor scatter scatter_add scatter_reduce searchsorted segment_reduce select select_scatter selu
    selu_ sgn sigmoid sigmoid_ sign signbit sin sin_ sinc sinc_ sinh sinh_ slice_scatter slogdet smm softmax sort
    split split_with_sizes spmm sqrt sqrt_ square square_ squeeze sspaddmm stack std std_mean stft sub subtract sum
    svd swapaxes swapdims t take take_along_dim tan tan_ tanh tanh_ tensor_split tensordot threshold threshold_
    tile topk trace transpose trapezoid trapz triangular_solve tril tril_indices triplet_margin_loss triu
    triu_indices true_divide trunc trunc_ unbind unflatten unique unique_consecutive unsafe_chunk unsafe_split
    unsafe_split_with_sizes unsqueeze vander var var_mean vdot view_as_complex view_as_real vsplit vstack where
    xlogy xlogy_ zero_ zeros zeros_like
    _adaptive_avg_pool2d _add_relu _add_relu_ _aminmax _batch_norm_impl_index _convolution _foreach_abs
    _foreach_abs_ _foreach_add _foreach_add_ _foreach_addcdiv _foreach_addcdiv_ _foreach_addcmul _foreach_addcmul_
    _foreach_clamp_max_ _foreach_clamp_min_ _foreach_div _foreach_div_ _foreach_lerp_ _foreach_maximum_
    _foreach_mul _foreach_mul_ _foreach_neg _foreach_neg_ _foreach_norm _foreach_pow _foreach_sqrt _foreach_sqrt_
    _foreach_sub _foreach_sub_ _fused_adam_ _fused_adamw_ _fused_sgd_ _softmax_backward_data
    linalg.cholesky linalg.cholesky_ex linalg.cond linalg.cross linalg.det linalg.diagonal linalg.eig linalg.eigh
    linalg.eigvals linalg.eigvalsh linalg.householder_product linalg.inv linalg.inv_ex linalg.ldl_factor
    linalg.ldl_factor_ex linalg.ldl_solve linalg.lstsq linalg.lu linalg.lu_factor linalg.lu_factor_ex
    linalg.lu_solve linalg.matmul linalg.matrix_exp linalg.matrix_norm linalg.matrix_power linalg.matrix_rank
    linalg.multi_dot linalg.norm linalg.pinv linalg.qr linalg.slogdet linalg.solve linalg.solve_ex
    linalg.solve_triangular linalg.svd linalg.svdvals linalg.tensorinv linalg.tensorsolve linalg.vander
    linalg.vecdot linalg.vector_norm
    """
)

VF: tuple[str, ...] = _names(
    """
    gru gru_cell lstm lstm_cell rnn_relu rnn_relu_cell rnn_tanh rnn_tanh_cell
    """
)

# torch_npu's own operators (only installed when torch_npu is importable).
NPU: tuple[str, ...] = _names(
    """
    _npu_dropout fast_gelu npu_add_rms_norm npu_anti_quant npu_apply_adam npu_apply_adam_w npu_apply_rotary_pos_emb
    npu_batch_nms npu_bert_apply_adam npu_bmmV2 npu_bounding_box_decode npu_bounding_box_encode npu_broadcast
    npu_ciou npu_confusion_transpose npu_conv2d npu_conv3d npu_conv_transpose2d npu_convolution
    npu_convolution_transpose npu_cross_entropy_loss npu_deformable_conv2d npu_dequant_swiglu_quant npu_diou
    npu_dropout_with_add_softmax npu_dtype_cast npu_dynamic_quant npu_dynamic_quant_asymmetric npu_fast_gelu
    npu_ffn npu_flash_attention npu_format_cast npu_fused_attention_score npu_fused_infer_attention_score
    npu_fusion_attention npu_fusion_attention_v2 npu_geglu npu_gelu npu_giou npu_group_norm_silu
    npu_grouped_matmul npu_gru npu_incre_flash_attention npu_indexing npu_iou npu_layer_norm_eval npu_linear
    npu_lstm npu_masked_fill_range npu_max npu_min npu_mish npu_moe_compute_expert_tokens npu_moe_finalize_routing
    npu_moe_gating_top_k npu_moe_gating_top_k_softmax npu_moe_init_routing npu_multi_head_attention npu_nms_rotated
    npu_nms_v4 npu_nms_with_mask npu_normalize_batch npu_one_hot npu_pad npu_prompt_flash_attention npu_ps_roi_pooling
    npu_ptiou npu_quant_matmul npu_quant_scatter npu_quantize npu_random_choice_with_mask npu_reshape npu_rms_norm
    npu_roi_align npu_rotary_mul npu_rotated_box_decode npu_rotated_box_encode npu_rotated_iou
    npu_rotated_overlaps npu_scaled_masked_softmax npu_scatter npu_scatter_nd_update npu_scatter_nd_update_
    npu_sign_bits_pack npu_sign_bits_unpack npu_silu npu_slice npu_softmax_cross_entropy_with_logits npu_sort_v2
    npu_stride_add npu_sub_sample npu_swiglu npu_transpose npu_weight_quant_batchmatmul npu_yolo_boxes_encode
    one_ scatter_update scatter_update_
    """
)

# torch.distributed's collectives and point-to-point calls: msprobe's list (its ``support_wrap_ops.yaml``), and the
# single-tensor names of recent torch versions (``all_gather_single``, ``reduce_scatter_single``, ``gather_single``,
# ``gather_into_tensor``), which the older names call. They are wrapped both in ``torch.distributed`` and in
# ``torch.distributed.distributed_c10d``, whose own functions call each other through that module's globals; a
# collective called by another is nested and recorded once, under the name the program called. ``barrier`` and
# the object collectives are left out as msprobe leaves them out: they carry no tensor worth comparing, and a
# record that an msprobe baseline lacks would show up as an unmatched call.
DISTRIBUTED: tuple[str, ...] = _names(
    """
    all_gather all_gather_into_tensor all_gather_single all_reduce all_to_all all_to_all_single batch_isend_irecv
    broadcast gather gather_into_tensor gather_single irecv isend recv reduce reduce_scatter reduce_scatter_single
    reduce_scatter_tensor scatter send _all_gather_base _reduce_scatter_base
    """
)

# torch.distributed.nn.functional: the collectives with autograd (wrapped only once that module is imported). They
# are recorded under the same ``Distributed.<name>`` as the plain collective they run, which is then nested and not
# recorded again; their backward records come from the autograd node of their output, like any other API's.
DISTRIBUTED_NN: tuple[str, ...] = _names(
    """
    all_gather all_reduce all_to_all all_to_all_single broadcast gather reduce reduce_scatter scatter
    _all_gather_base
    """
)
