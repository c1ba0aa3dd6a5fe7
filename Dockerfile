# turnkv: the gateway, and the simulated engines for trying it without GPUs (one image for both).
#
# BASE_IMAGE: any Debian-like image with python3 (>= 3.11) and its venv module. The default is Docker
# Hub's python:3.11-slim; scripts/compose-smoke builds a stand-in from Debian's packages where no image
# registry can be reached.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ENV PATH=/opt/turnkv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
# a virtual environment: the base's Python may be the system's (PEP 668), and stays untouched
RUN python3 -m venv /opt/turnkv \
 && /opt/turnkv/bin/pip install --no-cache-dir --disable-pip-version-check . \
 && useradd --system --uid 10001 --no-create-home turnkv \
 && install -d -o turnkv -g turnkv /var/lib/turnkv  # turnkv doctor's profile (a volume starts as this dir)
USER turnkv
EXPOSE 8000
ENTRYPOINT ["turnkv"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
