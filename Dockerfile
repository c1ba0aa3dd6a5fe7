# turnkv: the gateway (and the simulated engines, for trying it without GPUs)
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir . && useradd --system --uid 10001 turnkv
USER turnkv
EXPOSE 8000
ENTRYPOINT ["turnkv"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
