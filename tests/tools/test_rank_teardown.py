"""Layer 2 (two gloo processes): how the command-line tools end a rank's process group
(`dbo.cli.launch.end_process_group`, used by `dbo run/soak/...` and `dbo bench`). After a
clean finish the teardowns registered for the group run (DeepEP's buffers are destroyed
collectively, before interpreter exit, where a graphed deepep_ll bench segfaulted on 4
GPUs); after an error only torch's local teardown runs, since a peer may be gone.
"""
from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed


def _end(rank: int, world_size: int, clean: bool) -> tuple[list[bool], bool]:
    import torch.distributed as dist

    from dbo.cli.launch import end_process_group
    from dbo.groups import on_group_destroy

    seen: list[bool] = []
    on_group_destroy(lambda group: seen.append(group is dist.group.WORLD))
    end_process_group(clean=clean)
    return seen, dist.is_initialized()


@pytest.mark.distributed
@pytest.mark.parametrize("clean", [True, False])
def test_registered_teardowns_run_after_a_clean_finish_only(clean: bool) -> None:
    for seen, still_up in run_distributed(2, _end, clean):
        assert seen == ([True] if clean else []) and not still_up
