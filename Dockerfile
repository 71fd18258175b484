# conveyor: one image for every stage; compose.yaml picks the stage with the command.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
COPY conveyor conveyor
COPY engine engine
COPY kernels kernels
COPY protocol protocol
COPY services services
COPY scripts scripts
RUN pip install torch && pip install ".[gpu]"
# Models live on a volume; the default model is fetched into it on first start.
ENV CONVEYOR_TEST_MODEL=/models/SmolLM2-135M-Instruct HF_HOME=/models/hf
VOLUME /models
EXPOSE 23333
ENTRYPOINT ["conveyor"]
CMD ["serve", "stage", "ingress"]
