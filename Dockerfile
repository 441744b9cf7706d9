# One image for the router, the endpoint picker and the workers: `kvroute router`,
# `kvroute epp` or `kvroute worker`.
#
# The build stage compiles the wheel (the Cython index core needs a compiler); the runtime
# stage installs only that wheel, so no source folder sits in the working directory where
# Python would import it ahead of the installed package (a bare native/ has no compiled core).
#
# BASE_IMAGE is any image with Python 3.11+, pip and apt on PATH (python:3.11-slim by default;
# the container e2e test builds a stand-in from Debian's packages where no registry is reached).

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY native ./native
COPY indexer ./indexer
COPY openai_request ./openai_request
COPY workers ./workers
COPY router ./router
COPY httpapi ./httpapi
COPY bench ./bench
COPY kvroute ./kvroute
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/kvroute-*.whl \
    && rm -rf /wheels \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvroute
WORKDIR /app
RUN python -c "import indexer.index as i; assert i.IMPLEMENTATION == 'native'"
USER 10001:10001

# Containers listen on every interface; the compose file publishes only the router.
ENV KVROUTE_HOST=0.0.0.0 \
    KVROUTE_WORKER_HOST=0.0.0.0 \
    KVROUTE_WORKER_EVENTS_HOST=0.0.0.0
ENTRYPOINT ["kvroute"]
CMD ["router"]
