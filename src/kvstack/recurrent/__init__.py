"""Recurrent state of linear-attention layers (hybrid models): each sequence's live state and
the snapshots the prefix cache keeps beside its blocks, by block hash."""
