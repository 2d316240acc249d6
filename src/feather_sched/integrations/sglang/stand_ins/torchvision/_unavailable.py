"""Attributes of the stand-in are placeholders that raise as soon as they are used."""


class Unavailable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "Unavailable":
        return Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} was called, but torchvision is only a stand-in here")


def module_getattr(name: str) -> Unavailable:
    if name.startswith("__"):
        raise AttributeError(name)
    return Unavailable(f"torchvision.{name}")
