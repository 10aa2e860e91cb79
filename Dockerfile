# One image for every sluice service. The engine's packages (torch, transformers, ...) are the package's `engine`
# extra, so the API image, which also runs the webhooks worker and migrations, has none; the GPU worker image takes
# the CUDA wheel from PyPI, Triton, and a C compiler for Triton's launcher stubs (a CPU engine image: EXTRAS=engine,
# whose torch comes from the default CPU index):
#   docker build -t sluice:api .
#   docker build -t sluice:gpu --build-arg TORCH_INDEX_URL=https://pypi.org/simple --build-arg EXTRAS=gpu \
#                --build-arg APT_PACKAGES="gcc libc6-dev" .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
ARG APT_PACKAGES=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN if [ -n "$APT_PACKAGES" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $APT_PACKAGES && rm -rf /var/lib/apt/lists/*; \
    fi
# an engine image's torch first and alone: the largest layer, rebuilt only when its version or index changes
RUN if [ -n "$EXTRAS" ]; then pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; fi

WORKDIR /app
COPY pyproject.toml README.md ./
COPY sluice sluice
COPY api api
COPY kernels kernels
COPY migrations migrations
COPY worker worker
RUN pip install ".${EXTRAS:+[$EXTRAS]}"

RUN useradd --create-home --uid 1000 sluice
USER sluice
EXPOSE 8000
CMD ["sluice", "api", "--host", "0.0.0.0", "--port", "8000"]
