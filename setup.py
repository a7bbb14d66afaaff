from setuptools import find_packages, setup

JAX_VERSION = "0.10.2"

setup(
    name="dgemma_jax",
    version="0.1.0",
    description="DiffusionGemma (text diffusion with a Gemma 4 MoE) in JAX/Flax for TPUs",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["dgemma_jax", "dgemma_jax.*"]),
    include_package_data=True,
    package_data={"dgemma_jax": ["assets/*/*", "assets/*/*/*", "assets/*/*/*/*", "assets/*/*/*/*/*"]},
    python_requires=">=3.11",  # jax, jaxlib, flax and orbax-checkpoint at the pinned versions need 3.11
    install_requires=[
        f"jax=={JAX_VERSION}",
        "flax==0.12.8",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.8",
        "ml-collections==1.1.0",
        "numpy>=1.26",
        "safetensors>=0.4",
        # checkpoint locations (dgemma_jax/io/locations.py): fsspec URLs and Hub repo ids (gs:// needs the
        # [gcs] extra, which [tpu] includes)
        "fsspec>=2023.1",
        "etils[epath]",  # orbax's path type (io/convert.py restores through its handler)
        "huggingface_hub>=0.26",
        "ml-dtypes",
        "tokenizers>=0.20",
        "sentencepiece>=0.2",
        "prometheus_client>=0.20",  # the server's GET /metrics (dgemma_jax/serving/metrics.py)
        "Pillow>=10.1",  # images (dgemma_jax.io.images): loading, RGB conversion, the bicubic resize
        "jinja2>=3.1",  # checkpoints' chat templates (dgemma_jax.io.chat); not pulled by anything else without [ref]
        "tqdm",
        "rich",
        "matplotlib",
        # the server (`dgemma serve`)
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "starlette>=0.37",  # the server's 404/405 handler (fastapi's own dependency)
        "h11>=0.14",  # the server's header timeout on uvicorn's h11 protocol (uvicorn's own dependency)
        "pydantic>=2",
        # structured output (dgemma_jax/engine/grammar.py): JSON schema / regex token masks
        "llguidance>=1.9,<2",
        # its DINGO decoder (dgemma_jax/engine/dingo.py): a regex's character DFA (pure Python, no dependencies)
        # and a JSON schema's regex (outlines-core: a Rust wheel, no dependencies)
        "interegular>=0.3",
        "outlines-core>=0.2,<0.3",
    ],
    extras_require={
        # gcp-storage-emulator: the local GCS that gs:// training work directories are tested against
        # (tests/helpers/fake_gcs.py; the tests also need gcsfs, from [tpu] or [gcs])
        # jsonschema: structured output's answers validated (tests/test_structured*.py)
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.5", "openai>=1.40", "httpx>=0.27", "xprof>=2.24",
                 "ruff>=0.8", "gcp-storage-emulator>=2026.7", "jsonschema>=4.20"],
        # The numerical reference: Hugging Face transformers' diffusion_gemma on CPU. Not needed by the
        # default tests (they read tests/golden); install it with the CPU wheel index, else pip takes
        # the multi-GB CUDA build of torch:
        #   pip install -e ".[test,ref]" --extra-index-url https://download.pytorch.org/whl/cpu
        "ref": ["transformers==5.23.0", "torch==2.13.0"],
        "tpu": [f"jax[tpu]=={JAX_VERSION}", "gcsfs>=2023.1"],
        "gcs": ["gcsfs>=2023.1"],
    },
    entry_points={"console_scripts": ["dgemma=dgemma_jax.cli:main"]},
)
