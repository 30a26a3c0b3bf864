from services.worker.main import main
from shared.runner import run_service

run_service("worker", main)
