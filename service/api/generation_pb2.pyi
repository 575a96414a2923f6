from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "scheme", "max_positions", "train_context", "kv_cache_bytes_per_token", "n_layers", "n_heads", "head_dim", "dtype", "max_new_tokens_limit", "max_sequence_tokens", "kv_cache_capacity_bytes", "cache_policies", "default_cache_policy", "eviction_positions", "segment_reuse", "vocab_size", "bos_token_id", "eos_token_id", "add_bos", "kv_cache_bytes_per_sequence", "random_weights")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_POLICIES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_REUSE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_PER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RANDOM_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    scheme: str
    max_positions: int
    train_context: int
    kv_cache_bytes_per_token: int
    n_layers: int
    n_heads: int
    head_dim: int
    dtype: str
    max_new_tokens_limit: int
    max_sequence_tokens: int
    kv_cache_capacity_bytes: int
    cache_policies: _containers.RepeatedScalarFieldContainer[str]
    default_cache_policy: str
    eviction_positions: str
    segment_reuse: str
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    add_bos: bool
    kv_cache_bytes_per_sequence: int
    random_weights: bool
    def __init__(self, name: _Optional[str] = ..., scheme: _Optional[str] = ..., max_positions: _Optional[int] = ..., train_context: _Optional[int] = ..., kv_cache_bytes_per_token: _Optional[int] = ..., n_layers: _Optional[int] = ..., n_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., max_new_tokens_limit: _Optional[int] = ..., max_sequence_tokens: _Optional[int] = ..., kv_cache_capacity_bytes: _Optional[int] = ..., cache_policies: _Optional[_Iterable[str]] = ..., default_cache_policy: _Optional[str] = ..., eviction_positions: _Optional[str] = ..., segment_reuse: _Optional[str] = ..., vocab_size: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., add_bos: _Optional[bool] = ..., kv_cache_bytes_per_sequence: _Optional[int] = ..., random_weights: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "cache_policy", "ignore_eos", "min_tokens", "segments", "segment_repair_tokens", "logprobs", "prompt_logprobs", "prompt_token_ids", "speculative_tokens", "logit_bias", "cache_salt", "priority")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_REPAIR_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    cache_policy: str
    ignore_eos: bool
    min_tokens: int
    segments: _containers.RepeatedCompositeFieldContainer[PromptSegment]
    segment_repair_tokens: int
    logprobs: int
    prompt_logprobs: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculative_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    cache_salt: str
    priority: int
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., cache_policy: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[PromptSegment, _Mapping]]] = ..., segment_repair_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., speculative_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptSegment(_message.Message):
    __slots__ = ("text", "reusable")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REUSABLE_FIELD_NUMBER: _ClassVar[int]
    text: str
    reusable: bool
    def __init__(self, text: _Optional[str] = ..., reusable: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_prompt_tokens", "reused_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_prompt_tokens: int
    reused_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., reused_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("time_to_first_token_seconds", "total_seconds", "queue_seconds")
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token_seconds: float
    total_seconds: float
    queue_seconds: float
    def __init__(self, time_to_first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "finish_reason", "usage", "timings", "logprobs", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("text", "finish_reason", "usage", "timings", "logprobs", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("model", "text", "cache_policy")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    cache_policy: str
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., cache_policy: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("token_logprobs", "total_logprob", "tokens", "bits_per_byte", "greedy_tokens")
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BITS_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    GREEDY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    total_logprob: float
    tokens: int
    bits_per_byte: float
    greedy_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_logprobs: _Optional[_Iterable[float]] = ..., total_logprob: _Optional[float] = ..., tokens: _Optional[int] = ..., bits_per_byte: _Optional[float] = ..., greedy_tokens: _Optional[_Iterable[int]] = ...) -> None: ...
