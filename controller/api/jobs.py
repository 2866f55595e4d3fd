"""Training jobs as seen through their ranks' reports."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path

from controller.api.deps import AUTH_ERRORS, NOT_FOUND, Page, ServicesDep, require_viewer
from controller.auth import Principal
from controller.errors import NotFound
from controller.schemas import JobDetail, JobsPublic
from controller.services import queries
from controller.services.container import Services

router = APIRouter(tags=["jobs"])


@router.get("/jobs", operation_id="list_jobs", response_model=JobsPublic, responses=AUTH_ERRORS)
async def list_jobs(
    page: Page = Depends(),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> JobsPublic:
    state = services.state
    window = services.settings.node_lost_after_s
    jobs = sorted(state.jobs.values(), key=lambda j: j.name)
    data = [
        queries.job_public(state, j, active_within_s=window)
        for j in jobs[page.offset : page.offset + page.limit]
    ]
    return JobsPublic(data=data, count=len(jobs))


@router.get(
    "/jobs/{name}",
    operation_id="get_job",
    response_model=JobDetail,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def get_job(
    name: str = Path(max_length=253),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> JobDetail:
    job = services.state.jobs.get(name)
    if job is None:
        raise NotFound(f"job {name!r} not found")
    return queries.job_detail(
        services.state, job, active_within_s=services.settings.node_lost_after_s
    )
