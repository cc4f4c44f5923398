"""The one swap seam: what the swapper follows versions into, and the one weight handoff.

Contract: a `Swappable` serves one drafter model at a time (`model`, `version`) and takes a new
one in two halves: `offer(model, version)` from any thread (the swapper's), which raises if
`check_compatible(model)` does, and `apply_pending()` on the serving thread between two steps,
which installs the newest offer not yet taken (a later offer replaces one not yet taken) and
says whether it did; `withdraw()` drops an offer not yet taken (the live version went back to
the one serving: a rollback must not be undone by the offer it made obsolete). The engine's
drafters (token, feature, and the hybrid over either) and vLLM's drafter slot are all one; the
swapper (`specd.hotswap.swapper`) knows only this protocol.

`HotSwapped` is the implementation they share: the handoff, the kind check and the swap count.
A subclass names the weights it serves (`serves`), may convert them on the offering thread
(`prepare`: vLLM's slot moves tensors to its device there) and installs them (`install`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, cast, runtime_checkable

from specd.core.errors import BadWeights
from specd.drafter.base import Drafter
from specd.model.packed_linear import prepare_layouts

if TYPE_CHECKING:
    from specd.drafter.checkpoint import DrafterModel

Payload = TypeVar("Payload")


@runtime_checkable
class Swappable(Protocol):
    @property
    def version(self) -> int: ...

    @property
    def model(self) -> Any: ...

    @property
    def num_swaps(self) -> int: ...

    def check_compatible(self, model: DrafterModel) -> None:
        """Raise `BadWeights` (or a subclass) if `model` cannot serve here."""

    def offer(self, model: DrafterModel, version: int) -> None: ...

    def apply_pending(self) -> bool: ...

    def withdraw(self) -> int | None:
        """Drop the offer not yet taken; its version, or None when there was none."""


@runtime_checkable
class ServingDrafter(Drafter, Swappable, Protocol):
    """What servers run: a drafter the engine drives that the swapper follows versions into (the
    learned drafter alone, or the hybrid of it behind context matching)."""


class WeightHandoff(Generic[Payload]):
    """New weights offered from any thread, taken by the serving thread between steps; a later
    offer replaces one not yet taken."""

    def __init__(self) -> None:
        self._pending: tuple[Payload, int] | None = None
        self._lock = threading.Lock()

    def put(self, payload: Payload, version: int) -> None:
        with self._lock:
            self._pending = (payload, version)

    def take(self) -> tuple[Payload, int] | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return pending


class HotSwapped(Generic[Payload]):
    serves: ClassVar[type]   # the class of model weights this drafter serves

    def __init__(self, version: int) -> None:
        self._version = version
        self._handoff: WeightHandoff[Payload] = WeightHandoff()
        self.num_swaps = 0

    @property
    def version(self) -> int:
        return self._version

    def check_compatible(self, model: DrafterModel) -> None:
        if not isinstance(model, self.serves):
            raise BadWeights(f"a {type(self).__name__} serves {self.serves.__name__} weights, "
                             f"not {type(model).__name__}")

    def prepare(self, model: DrafterModel) -> Payload:
        """What `install` takes, made on the offering thread (by default the model itself, its
        linear layers' inference layouts made here rather than in the first step that uses them)."""
        prepare_layouts(model)
        return cast(Payload, model)

    def offer(self, model: DrafterModel, version: int) -> None:
        """Hand over checked weights from any thread; they take over at the next `apply_pending`."""
        self.check_compatible(model)
        self._handoff.put(self.prepare(model), version)

    def take(self) -> tuple[Payload, int] | None:
        """The pending offer, removed (None when there is none)."""
        return self._handoff.take()

    def withdraw(self) -> int | None:
        pending = self.take()
        return None if pending is None else pending[1]

    def apply_pending(self) -> bool:
        """Install the pending offer now; only between steps, on the serving thread."""
        pending = self.take()
        if pending is None:
            return False
        self.install(pending[0])
        self._version = pending[1]
        self.num_swaps += 1
        return True

    def install(self, payload: Payload) -> None:
        raise NotImplementedError
