from services.autoscaler.main import main
from shared.runner import run_service

run_service("autoscaler", main)
