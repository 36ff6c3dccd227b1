"""Build script: pure-Python install; the CUDA extension is added in csrc/ (see README)."""
from setuptools import setup

setup()
