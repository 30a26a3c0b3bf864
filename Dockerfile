# One image for every kvlane service; the command picks the service.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY contracts ./contracts
COPY shared ./shared
COPY services ./services
COPY kvlane ./kvlane
COPY loadtest ./loadtest
RUN pip install --no-cache-dir .
ENV KVLANE__LOGGING__FORMAT='"json"'
CMD ["python", "-m", "services.ingress"]
