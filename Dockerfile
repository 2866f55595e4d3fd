# One image per component, built as two targets of this file; the Helm chart's default
# image names are the targets' titles (a test in tests/helm checks they agree):
#
#   docker build --target controller -t registry.example.com/ml/trainguard-controller:0.1.0 .
#   docker build --target agent      -t registry.example.com/ml/trainguard-agent:0.1.0 .
#
# then `helm install ... --set image.registry=registry.example.com/ml`.
#
# Both hold the `trainguard` package without torch (`pip install trainguard` pulls none: the
# controller never imports it and the agent does not need it); training images install
# `trainguard[train]` next to their own CUDA build of torch. Both run as uid 65532, the
# chart's non-root user (the agent is run as root only with agent.privileged).
#
# Not built in CI here (no container runtime on the build machines); see
# docs/kubernetes.md#install-with-helm.
# The dashboard's browser code (web/frontend -> web/static): npm packages pinned by the
# lockfile, bundled by esbuild; only the built files reach the Python image.
FROM node:20-slim AS web
WORKDIR /src/web/frontend
COPY web/frontend/package.json web/frontend/package-lock.json ./
RUN npm ci --no-audit --no-fund
COPY web/frontend/build.mjs ./
COPY web/frontend/src ./src
RUN node build.mjs

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trainguard ./trainguard
COPY controller ./controller
COPY agents ./agents
COPY collectives ./collectives
COPY checkpoint ./checkpoint
COPY power ./power
COPY web ./web
COPY --from=web /src/web/static ./web/static
COPY demojob ./demojob
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim AS runtime
COPY --from=build /install /usr/local
RUN useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin trainguard
USER 65532:65532

# The controller: API, dashboard, detectors, actuators; PostgreSQL or SQLite.
FROM runtime AS controller
LABEL org.opencontainers.image.title="trainguard-controller"
USER 65532:65532
EXPOSE 8470
ENTRYPOINT ["trainguard", "controller"]

# The node agent: NVML sampler, spool, the job-side socket, metrics.
FROM runtime AS agent
LABEL org.opencontainers.image.title="trainguard-agent"
USER 65532:65532
EXPOSE 9470
ENTRYPOINT ["trainguard", "agent"]
