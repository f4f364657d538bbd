"""Handoff bytes through Ray's object store: `ray.put` on the prefill replica (which owns the
object while its lease holds the reference), the reference through the ingress, `await` on
the decode replica. Ray frees the object once every holder has dropped its reference; the
owner dying first makes it unreachable, which the decode side takes as a miss."""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray.exceptions import ObjectLostError, OwnerDiedError, RayError

from kvstack.cluster.pd.handoff import HandoffMiss


class RayCourier:
    def put(self, blocks: list[bytes]) -> Any:
        return ray.put(blocks)

    async def get(self, ref: Any, timeout_s: float) -> list[bytes]:
        try:
            blocks: list[bytes] = await asyncio.wait_for(asyncio.wrap_future(ref.future()),
                                                         timeout_s)
        except TimeoutError as err:
            raise HandoffMiss("late", f"handoff not there within {timeout_s} s") from err
        except (OwnerDiedError, ObjectLostError) as err:
            raise HandoffMiss("lost", f"handoff lost: {type(err).__name__}") from err
        except RayError as err:  # any other failure to fetch is a miss too, never an error
            raise HandoffMiss("lost", f"handoff unreachable: {type(err).__name__}") from err
        return blocks
