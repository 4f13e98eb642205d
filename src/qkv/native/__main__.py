"""`python -m qkv.native`: build the kernels now (as `make` does) and say what was chosen."""

from qkv import native

if __name__ == "__main__":
    print(native.describe())
