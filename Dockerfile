# One image for the router and the workers: `kvroute router` or `kvroute worker`.
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY native ./native
COPY indexer ./indexer
COPY workers ./workers
COPY router ./router
COPY httpapi ./httpapi
COPY bench ./bench
COPY kvroute ./kvroute
RUN pip install --no-cache-dir . \
    && python -c "import indexer.index as i; assert i.IMPLEMENTATION == 'native'"

# Containers listen on every interface; the compose file publishes only the router.
ENV KVROUTE_HOST=0.0.0.0 \
    KVROUTE_WORKER_HOST=0.0.0.0 \
    KVROUTE_WORKER_EVENTS_HOST=0.0.0.0
ENTRYPOINT ["kvroute"]
CMD ["router"]
