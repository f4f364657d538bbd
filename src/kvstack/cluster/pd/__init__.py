"""Prefill/decode disaggregation (`kvstack serve --replicas N --prefill-replicas P`).

P replicas only prefill: they run a request to its first token (streamed to the client at
once) and hand its full prompt blocks, encoded by the tier block codec, to one of the N - P
decode replicas, which admits prompt + first token as an exact prefix hit and streams the rest.

- `handoff`: what travels (`Handoff`, `Receipt`), the prefill side's leases (held until the
  decode side acknowledges, or freed by a timeout), the byte courier (`LocalCourier` in
  process; `ray_courier.RayCourier`: Ray object refs), the ingress's counters, and which
  requests may be handed over at all (`handoff_safe`);
- `tiers`: `HandoffTiers`, the `BlockTiers` both roles install in their engine over its own
  chain: a prefill replica captures published blocks there, a decode replica restores
  received ones from there after the codec's checks (fingerprint, dtype, layout, hash, crc);
- `replicas`: `PrefillReplica` and `DecodeReplica`, `EngineReplica`s with those roles;
- `ingress`: `PDClusterEngine`, the ingress's `ClusterEngine` over both pools.

Anything missing, late or corrupt is recomputed by the decode replica (a counted fallback),
never served wrong: the decode side's own block hashes decide which bytes it may use.
"""
