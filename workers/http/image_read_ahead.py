"""How far a request's image fetches may run ahead of the images' use, in bytes.

A chat request's remote images are fetched concurrently and used (hashed into their digests,
:func:`workers.http.image_fetch.remote_image_digests`) one at a time, in the order of their
parts; an image's bytes go once it is used. Between its fetch and its use an image is held in
memory, so without a bound a request holds every image it names at once (16 of 20 MiB by the
default limits). :class:`ReadAhead` bounds those bytes, fetched and not yet used, to
``max_image_read_ahead_bytes`` (64 MiB by default) without refusing anything:

1. The images are numbered in the order of their use; the *current* image is the one being
   used or awaited; the images before it are used and gone; the ones after it are *ahead*.
2. A fetch asks before each read of its answer (:meth:`ReadAhead.may_read`), which brings at
   most :data:`READ_BYTES` (httpcore reads 64 KiB at a time; only a content-encoded answer's
   decoded piece is larger). Until it may, it reads nothing more from its answer: the rest
   of the image waits in the connection, not in the request's pieces.
3. The current image may read while one more read stays within the bound. An image ahead may
   read only while the images ahead, after that read, leave room for a whole current image
   and one read (``max_image_bytes + READ_BYTES``). So the current image can always be
   fetched whole, and the use never waits on a fetch that waits on the use: the bound is at
   least one image and two reads (the settings refuse less).
4. An image's bytes count from the read that brings them until it is used
   (:meth:`ReadAhead.used`); the next image is then current, and the fetches waiting for
   room look again.

So the bytes a request holds stay within the bound however many images it names and however
fast their hosts answer; images still arrive concurrently while they fit. The request's own
total (``max_image_request_bytes``) and the worker's budget (``max_image_fetch_bytes``) are
counted as before, on the bytes fetched.
"""

from __future__ import annotations

import asyncio

__all__ = ["READ_BYTES", "ReadAhead", "least_read_ahead"]

#: The most one read of an image's answer brings (httpcore's read size).
READ_BYTES = 64 * 1024


def least_read_ahead(max_image_bytes: int) -> int:
    """The smallest bound that lets an image of ``max_image_bytes`` through (rule 3)."""
    return max_image_bytes + 2 * READ_BYTES


class ReadAhead:
    """The bytes of one request's images fetched and not yet used (module docstring).

    Invariants:
        1. ``held`` is the sum of the bytes each image not yet used has read; it stays within
           ``limit`` while each read brings at most :data:`READ_BYTES`.
        2. The images ahead of the current one hold at most ``limit - max_image_bytes -
           READ_BYTES``: the current image always has room to be read whole.

    Args:
        limit: the bytes held at most.
        max_image_bytes: the largest image a fetch accepts.

    Raises:
        ValueError: ``limit`` is less than :func:`least_read_ahead` of ``max_image_bytes``.
    """

    def __init__(self, limit: int, max_image_bytes: int) -> None:
        least = least_read_ahead(max_image_bytes)
        if limit < least:
            raise ValueError(f"the image read-ahead must hold one whole image and two reads: "
                             f"at least {least} bytes for images of {max_image_bytes}, "
                             f"got {limit}")
        self.limit = limit
        self.max_image_bytes = max_image_bytes
        #: Bytes read and not yet used, all images together.
        self.held = 0
        #: The most :attr:`held` has been.
        self.peak = 0
        #: The image being used or awaited.
        self.current = 0
        self._read: dict[int, int] = {}
        #: The images let read and not yet read, each held a read's bytes until it has.
        self._reading: set[int] = set()
        self._ahead = 0  # bytes read and reads let by the images after the current one
        # Made when a fetch waits for room (most requests' images fit at once).
        self._moved: asyncio.Event | None = None

    def fits(self, image: int) -> bool:
        """Whether ``image`` may read its next piece now (rule 3)."""
        if self.held + len(self._reading) * READ_BYTES + READ_BYTES > self.limit:
            return False
        return (image <= self.current
                or self._ahead + 2 * READ_BYTES + self.max_image_bytes <= self.limit)

    async def may_read(self, image: int) -> None:
        """Return once ``image`` may read its next piece (rule 3), and count a read's bytes
        for it until :meth:`read` or :meth:`ended` says what came."""
        assert image not in self._reading, f"image {image} asked twice before reading"
        while not self.fits(image):
            moved = self._moved
            if moved is None:
                moved = self._moved = asyncio.Event()
            await moved.wait()
        self._reading.add(image)
        if image > self.current:
            self._ahead += READ_BYTES

    def read(self, image: int, n: int) -> None:
        """``image``, let read, read ``n`` bytes."""
        assert image >= self.current, f"image {image} read after its use"
        self._let_go(image)
        self._read[image] = self._read.get(image, 0) + n
        self.held += n
        if image > self.current:
            self._ahead += n
        self.peak = max(self.peak, self.held)

    def ended(self, image: int) -> None:
        """``image``'s answer ended: the read it was let make brought nothing."""
        self._let_go(image)
        self._moved_on()

    def used(self, image: int) -> None:
        """``image``, the current one, was used: its bytes go and the next is current."""
        assert image == self.current, f"image {image} used while {self.current} is current"
        self._let_go(image)
        self.held -= self._read.pop(image, 0)
        self.current += 1
        nxt = self.current
        self._ahead -= self._read.get(nxt, 0) + (READ_BYTES if nxt in self._reading else 0)
        self._moved_on()

    def _let_go(self, image: int) -> None:
        if image in self._reading:
            self._reading.discard(image)
            if image > self.current:
                self._ahead -= READ_BYTES

    def _moved_on(self) -> None:
        moved = self._moved
        if moved is not None:
            self._moved = None
            moved.set()
