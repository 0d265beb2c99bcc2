"""A column of non-negative ints that travels as packed machine integers."""
from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_TYPECODES = ("B", "H", "I", "Q")  # 1, 2, 4, 8 bytes, unsigned


class IntColumn(array):
    """An `array.array` of unsigned ints (equal to another array of the same values).

    On the wire it is one msgpack bin: the typecode byte, then the values little-endian, so a
    step's column of token counts decodes without allocating an int per request, and a worker
    can view it with numpy without copying.
    """

    def __new__(cls, values: Iterable[int] = (), typecode: str = "I") -> IntColumn:
        return super().__new__(cls, typecode, values)

    @staticmethod
    def typecode_for(bound: int) -> str:
        """The narrowest typecode for values below `bound`."""
        for code in _TYPECODES:
            if bound <= 1 << (8 * array(code).itemsize):
                return code
        raise OverflowError(f"no integer column holds values up to {bound}")

    @classmethod
    def for_bound(cls, values: Iterable[int], bound: int) -> IntColumn:
        """The narrowest column for values below `bound`."""
        return cls(values, cls.typecode_for(bound))

    @classmethod
    def from_native_bytes(cls, typecode: str, data: bytes) -> IntColumn:
        """A column of `typecode` over values in this machine's byte order (e.g. a numpy
        array's `astype(typecode).tobytes()`)."""
        column = cls((), typecode)
        column.frombytes(data)
        return column

    @classmethod
    def narrowest(cls, values: Iterable[int]) -> IntColumn:
        values = list(values)
        return cls.for_bound(values, max(values, default=0) + 1)

    def to_wire(self) -> bytes:
        data = self if sys.byteorder == "little" else array(self.typecode, self).byteswap()
        return self.typecode.encode() + data.tobytes()

    @classmethod
    def from_wire(cls, data: bytes) -> IntColumn:
        if not data or chr(data[0]) not in _TYPECODES:
            raise ValueError("an integer column must start with a typecode of " +
                             "".join(_TYPECODES))
        column = cls((), chr(data[0]))
        if (len(data) - 1) % column.itemsize:
            raise ValueError(f"{len(data) - 1} bytes do not hold whole {column.itemsize}-byte ints")
        column.frombytes(data[1:])
        if sys.byteorder != "little":
            column.byteswap()
        return column

    def __repr__(self) -> str:
        return f"IntColumn({self.tolist()})"
