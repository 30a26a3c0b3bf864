from services.health_prober.main import main
from shared.runner import run_service

run_service("health_prober", main)
