"""When qae shards a model itself (qae_app/models/sharding.py): accelerate trains an FSDP config unsharded (as DDP)
on CPU, so qae shards an FSDP2 config with torch's fully_shard and refuses an FSDP1 one. The 2-process runs that
shard are tests/e2e/test_fsdp2.py's."""

import pytest


def test_fsdp1_on_cpu_is_refused_not_silently_unsharded(monkeypatch):
    """accelerate trains an FSDP1 config unsharded on CPU: qae says so instead of pretending."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from qae_app.core.errors import QAEUserError
    from qae_app.models.sharding import shards_itself

    cpu_ddp = SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(QAEUserError, match="fsdp_version: 2"):
        shards_itself(cpu_ddp)
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert shards_itself(cpu_ddp)
    assert not shards_itself(SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO))
    assert not shards_itself(SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP))  # accelerate's
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert not shards_itself(cpu_ddp)
