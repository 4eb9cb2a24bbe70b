"""The KV pool's default size (`kv_sizing`): what the workload needs, capped by free memory,
never less than one request of max_model_len."""
import pytest

from specjax.engine.config import TYPICAL_CONTEXT, EngineConfig, kv_sizing
from specjax.models import ModelConfig
from specjax.speculative.build import build_speculation

SMOLLM2 = ModelConfig(vocab_size=64, hidden_size=576, intermediate_size=64, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # K and V, float32, 16 tokens a block


@pytest.fixture(scope="module")
def plain():
    return build_speculation(None, None, 8192)


def test_a_long_maximum_does_not_size_the_pool(plain):
    per_seq, blocks = kv_sizing(EngineConfig(max_batch_size=8), plain, 8192, SMOLLM2, 1 << 40)
    assert per_seq == 8192 // 16
    assert blocks == 8 * TYPICAL_CONTEXT // 16 + 1  # not 8 x 512 blocks (3 GB in float32)


def test_short_maxima_keep_room_for_every_row(plain):
    per_seq, blocks = kv_sizing(EngineConfig(max_batch_size=4), plain, 512, SMOLLM2, 1 << 40)
    assert blocks == 4 * per_seq + 1


def test_free_memory_caps_the_pool_but_one_request_always_fits(plain):
    config = EngineConfig(max_batch_size=8, kv_memory_fraction=0.5)
    _, blocks = kv_sizing(config, plain, 8192, SMOLLM2, free=2 * 700 * BLOCK_BYTES)
    assert blocks == 700 + 1
    per_seq, blocks = kv_sizing(config, plain, 8192, SMOLLM2, free=10 * BLOCK_BYTES)
    assert blocks == per_seq + 1


def test_num_kv_blocks_overrides_and_is_checked(plain):
    config = EngineConfig(max_batch_size=8, num_kv_blocks=9000)
    assert kv_sizing(config, plain, 8192, SMOLLM2, free=0)[1] == 9000
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len 8192"):
        kv_sizing(EngineConfig(num_kv_blocks=100), plain, 8192, SMOLLM2)
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        EngineConfig(kv_memory_fraction=0)
