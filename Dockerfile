# The image the Helm chart runs: the `trainguard` command for both the controller and the
# node agent. torch is left out on purpose (the controller never imports it and the agent
# does not need it), which keeps the image small; training images install
# `trainguard[train]` themselves.
#
#   docker build -t registry.example.com/ml/trainguard:0.1.0 .
#
# Not built in CI here (no container runtime on the build machines); see
# docs/kubernetes.md#install-with-helm.
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
COPY demojob ./demojob
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
# The chart's non-root user (controller, and the agent unless agent.privileged is set).
RUN useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin trainguard
USER 65532:65532
EXPOSE 8470 9470
ENTRYPOINT ["trainguard"]
CMD ["--help"]
