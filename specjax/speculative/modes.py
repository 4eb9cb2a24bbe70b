"""Speculative decoding modes. Behaviour is chosen by these predicates, never by name chains;
`specjax.speculative.build` says what each one drives. (TensorRT-LLM's `without_logits` has
nothing to drive here: no step returns logits to the host.)

The numeric values are part of the serialized config format: never renumber or reuse them
(2, 4 and 8 are retired).
"""
from __future__ import annotations

import enum


class SpeculativeDecodingMode(enum.IntEnum):
    MTP = 1
    MTP_EAGLE_ONE_MODEL = 3
    EAGLE3_ONE_MODEL = 5
    NGRAM = 6
    SA = 7
    DRAFT_TARGET_ONE_MODEL = 9
    USER_PROVIDED = 10
    SAVE_HIDDEN_STATES = 11
    PARD = 12
    DFLASH = 13
    DSPARK = 14
    NONE = 15
    AUTO = 16

    @classmethod
    def parse(cls, value: "int | str | SpeculativeDecodingMode") -> "SpeculativeDecodingMode":
        """A mode from its integer, its name or a short name, any case, '-' for '_' (5, "5",
        "EAGLE3_ONE_MODEL", "eagle3", "draft-target", ...)."""
        if isinstance(value, cls):
            return value
        key = value.strip().lower().replace("-", "_") if isinstance(value, str) else None
        if key in MODE_NAMES:
            return MODE_NAMES[key]
        number = value if isinstance(value, int) and not isinstance(value, bool) else (
            int(key) if key is not None and key.isdigit() else None)
        if number in cls._value2member_map_:
            return cls(number)
        raise ValueError(f"unknown speculative decoding mode {value!r}: use one of "
                         f"{', '.join(sorted(MODE_NAMES))} or the mode's integer")

    def use_one_engine(self) -> bool:
        """Drafter and target run inside one jitted step."""
        return self in _ONE_ENGINE

    def needs_kv_cache_rewind(self) -> bool:
        """Rejected draft positions must be returned to the KV pool: every mode whose drafts
        the target verifies in its pool (TensorRT-LLM leaves USER_PROVIDED out; specjax
        verifies a user's drafts exactly like NGram's, so they need it too)."""
        return self.use_one_engine() or self.has_spec_drafter()

    def support_overlap_scheduler(self) -> bool:
        """The host may process step N while the device runs step N+1."""
        return self.use_one_engine()

    def has_spec_decoder(self) -> bool:
        """The step itself drafts, verifies and accepts."""
        return self.use_one_engine()

    def has_draft_module(self) -> bool:
        """A drafter module with parameters rides in the step (an in-step worker); SA drafts
        from the request's own tokens and has none."""
        return self.use_one_engine() and self is not SpeculativeDecodingMode.SA

    def is_parallel_draft(self) -> bool:
        """The drafter proposes all D tokens in one forward pass (PARD, DFlash, DSPARK) rather
        than one pass per token; the bench reports its draft cost as one pass."""
        return self in (SpeculativeDecodingMode.PARD, SpeculativeDecodingMode.DFLASH,
                        SpeculativeDecodingMode.DSPARK)

    def has_spec_drafter(self) -> bool:
        """A host-side Drafter only proposes tokens; the target verifies them."""
        return self in (SpeculativeDecodingMode.NGRAM, SpeculativeDecodingMode.USER_PROVIDED)


_ONE_ENGINE = frozenset({
    SpeculativeDecodingMode.MTP, SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL,
    SpeculativeDecodingMode.EAGLE3_ONE_MODEL, SpeculativeDecodingMode.SA,
    SpeculativeDecodingMode.PARD, SpeculativeDecodingMode.DFLASH,
    SpeculativeDecodingMode.DSPARK, SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL,
})


# Short names (what `--speculative-config NAME` and `{"mode": "NAME"}` take); every full enum
# name is accepted too (lower case).
MODE_NAMES: dict[str, SpeculativeDecodingMode] = {
    **{m.name.lower(): m for m in SpeculativeDecodingMode},
    "eagle3": SpeculativeDecodingMode.EAGLE3_ONE_MODEL,
    "mtp_eagle": SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL,
    "draft_target": SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL,
}
